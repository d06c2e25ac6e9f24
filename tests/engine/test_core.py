"""The bindings (`fastpersist._core`) through Python, on real files, on both backends.

What the Rust tests cannot see lives here: buffer-protocol sources and destinations, the GIL
being released, exceptions (errno, filename, our hierarchy), per-process backend selection,
and real small filesystems (tmpfs) for O_DIRECT refusal and ENOSPC.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import pytest

import fastpersist
from fastpersist import _core
from fastpersist.engine import Guard, JobHooks, WriteOptions, WriteRequest, start_write

from backends import uring_available

ALIGN = _core.DIRECT_ALIGN_BYTES
CHUNK = 64 << 10
MIB = 1 << 20

ReadPart = tuple[str, int, int, list[int]]
Backend = Literal["io_uring", "threads"]
DirectIO = Literal["auto", "require", "off"]


def start_engine_write(
    plan: _core.Plan,
    writer: int,
    paths: Sequence[str | Path],
    sources: Sequence[object],
    pool: _core.Pool,
    *,
    also_writers: Sequence[int] = (),
    background: bool = False,
    hooks: JobHooks | None = None,
    **options: Any,
) -> _core.WriteHandle:
    """The engine's write, started as the library starts it (a fastpersist.engine.WriteRequest);
    `options`: the fields of its WriteOptions."""
    return start_write(
        WriteRequest(
            plan=plan,
            writer=writer,
            paths=list(paths),
            sources=list(sources),
            pool=pool,
            also_writers=also_writers,
            background=background,
            options=WriteOptions(**options),
            hooks=hooks or JobHooks(),
        )
    )


URING = uring_available()
BACKENDS = [
    "threads",
    pytest.param(
        "io_uring",
        marks=pytest.mark.skipif(not URING, reason="io_uring is blocked or missing on this kernel"),
    ),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    return cast(Backend, request.param)


# --- helpers -------------------------------------------------------------------------------


def read_whole(parts: Sequence[ReadPart], dest: Any, **options: Any) -> int:
    """Reads whole files, given as ``(path, len_bytes, dest_offset_bytes, chunk_crc32c)``."""
    ranges = [(path, n, 0, n, offset, crcs) for path, n, offset, crcs in parts]
    return _core.read_ranges_into(ranges, dest, **options)


def round_up(value: int, align: int = ALIGN) -> int:
    return (value + align - 1) // align * align


def aligned_empty(nbytes: int) -> np.ndarray:
    """A uint8 array of `nbytes` whose first byte is ALIGN-aligned (for O_DIRECT reads)."""
    raw = np.empty(nbytes + 2 * ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    out = raw[start : start + nbytes]
    assert out.ctypes.data % ALIGN == 0
    return out


def read_dest(total_bytes: int) -> np.ndarray:
    """Room for the stream, padded so that O_DIRECT may read whole aligned blocks."""
    dest = aligned_empty(round_up(total_bytes) + ALIGN)
    dest.fill(0xAB)
    return dest


def random_extents(sizes: Sequence[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=n, dtype=np.uint8) for n in sizes]


def expected_stream(plan: _core.Plan, extents: Sequence[np.ndarray]) -> np.ndarray:
    stream = np.zeros(plan.total_bytes, dtype=np.uint8)
    for offset, data in zip(plan.extent_offsets, extents, strict=True):
        stream[offset : offset + data.size] = data
    return stream


def write_all(
    plan: _core.Plan,
    extents: Sequence[Any],
    dirs: Sequence[Path],
    pool: _core.Pool,
    **options: Any,
) -> tuple[list[ReadPart], list[_core.WriteReport]]:
    """Writes every writer's parts (writer by writer); returns read_whole parts and the reports."""
    writer_count = max((w for w, _, _, _ in plan.parts), default=0) + 1
    read_parts: list[ReadPart] = []
    reports = []
    for writer in range(writer_count):
        mine = [p for p in plan.parts if p[0] == writer]
        paths = [dirs[stripe] / f"w{writer}-s{stripe}.bin" for _, stripe, _, _ in mine]
        report = start_engine_write(plan, writer, paths, extents, pool, **options).wait()
        assert [p["path"] for p in report["parts"]] == [str(p) for p in paths]
        for (_, _, offset, length), part in zip(mine, report["parts"], strict=True):
            assert part["len_bytes"] == length == os.path.getsize(part["path"])
            read_parts.append((part["path"], length, offset, part["chunk_crc32c"]))
        reports.append(report)
    return read_parts, reports


def one_file(
    tmp_path: Path, nbytes: int, backend: Backend, chunk_bytes: int = CHUNK, **options: Any
) -> tuple[np.ndarray, list[ReadPart], _core.WriteReport]:
    """Writes one random extent of `nbytes` to `tmp_path/w0-s0.bin`."""
    (data,) = random_extents([nbytes], seed=nbytes)
    plan = _core.Plan([nbytes], chunk_bytes=chunk_bytes)
    pool = _core.Pool(chunk_bytes, 8 * chunk_bytes)
    parts, (report,) = write_all(plan, [data], [tmp_path], pool, backend=backend, **options)
    return data, parts, report


@contextlib.contextmanager
def mounted(fstype: str, where: Path, *options: str) -> Iterator[Path]:
    """Mounts a fresh in-memory filesystem at `where` (root only; skips where mounting is refused)."""
    if os.geteuid() != 0:
        pytest.skip(f"mounting a {fstype} needs root")
    where.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", fstype, *(["-o", ",".join(options)] if options else []), fstype, str(where)]
    done = subprocess.run(mount, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a {fstype} here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


@contextlib.contextmanager
def no_direct_fs(where: Path) -> Iterator[Path]:
    """A filesystem that refuses O_DIRECT: tmpfs before Linux 6.6, else ramfs."""
    with mounted("tmpfs", where, "size=64m") as mem:
        if not _core.direct_io_supported(mem):
            yield mem
            return
    with mounted("ramfs", where) as mem:
        if _core.direct_io_supported(mem):
            pytest.skip("neither tmpfs nor ramfs refuses O_DIRECT here")
        yield mem


# --- Plan and Pool -------------------------------------------------------------------------


def test_plan_layout_and_validation() -> None:
    plan = _core.Plan([1, 3, 64, 0, 65], chunk_bytes=4096)
    assert plan.extent_offsets == [0, 64, 128, 192, 192]
    assert plan.total_bytes == 257
    assert plan.chunk_bytes == 4096
    assert plan.parts == [(0, 0, 0, 257)]
    assert _core.Plan([1]).chunk_bytes == 8 << 20
    plan = _core.Plan([10 * CHUNK], writer_count=2, stripe_count=3, chunk_bytes=CHUNK)
    assert sum(length for _, _, _, length in plan.parts) == 10 * CHUNK
    assert {(w, s) for w, s, _, _ in plan.parts} == {(w, s) for w in range(2) for s in range(3)}
    with pytest.raises(ValueError, match="chunk_bytes"):
        _core.Plan([1], chunk_bytes=1000)
    with pytest.raises(ValueError, match="writer_count"):
        _core.Plan([1], writer_count=0)
    with pytest.raises(OverflowError):
        _core.Plan([-1])


def test_the_chunk_rule_comes_from_the_core() -> None:
    """The plan, the reads, the manifest check and the group load all use these helpers."""
    for bad in (0, 1000, ALIGN + 512, _core.MAX_CHUNK_BYTES + ALIGN):
        with pytest.raises(ValueError, match=rf"chunk_bytes \({bad}\) must be a positive multiple of {ALIGN}"):
            _core.check_chunk_bytes(bad)
        with pytest.raises(ValueError, match="chunk_bytes"):
            _core.chunk_count(10, bad)
    _core.check_chunk_bytes(_core.MAX_CHUNK_BYTES)
    assert _core.chunk_count(0, ALIGN) == 0
    assert _core.chunk_count(2 * ALIGN + 1, ALIGN) == 3
    assert _core.chunk_spans(2 * ALIGN + 1, ALIGN) == [(0, ALIGN), (ALIGN, ALIGN), (2 * ALIGN, 1)]
    assert _core.chunk_spans(0, ALIGN) == []
    # Writers share whole chunks exactly as chunk_runs cuts the stream.
    total = 10 * CHUNK + 5
    plan = _core.Plan([total], writer_count=3, stripe_count=1, chunk_bytes=CHUNK)
    runs = _core.chunk_runs(0, total, CHUNK, 3)
    assert [(offset, offset + length) for _, _, offset, length in plan.parts] == runs
    assert runs == [(0, 3 * CHUNK), (3 * CHUNK, 7 * CHUNK), (7 * CHUNK, total)]  # 11 chunks: 3, 4, 4
    assert _core.chunk_runs(CHUNK, 2 * CHUNK, CHUNK, 3) == [(CHUNK, CHUNK), (CHUNK, CHUNK), (CHUNK, 2 * CHUNK)]
    with pytest.raises(ValueError, match="chunk-aligned start_bytes"):
        _core.chunk_runs(1, 2 * CHUNK, CHUNK, 2)
    with pytest.raises(ValueError, match="count >= 1"):
        _core.chunk_runs(0, CHUNK, CHUNK, 0)


def test_pool_is_bounded_and_lazy() -> None:
    pool = _core.Pool(5000, 100_000)
    assert pool.slot_bytes == 8192  # rounded up to the O_DIRECT alignment
    assert pool.slot_count == 100_000 // 8192
    assert pool.allocated_bytes == 0
    assert _core.Pool(MIB, 0).slot_count == 2  # never fewer than two (double buffering)
    with pytest.raises(ValueError, match="slot_bytes"):
        _core.Pool(0, MIB)


# --- write, read back ----------------------------------------------------------------------

SIZES = {
    "empty": [0],
    "one": [1],
    "page-1": [4095],
    "page+1": [4097],
    "several": [1, 0, 4095, 4097, 3 * CHUNK + 7, 64, 100_000],
    "3MiB+5": [3 * MIB + 5],
}


@pytest.mark.parametrize("sizes", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("direct_io", ["auto", "off"])
@pytest.mark.parametrize("writer_count", [1, 2])
@pytest.mark.parametrize("stripe_count", [1, 2, 3])
def test_write_read_round_trip(
    tmp_path: Path,
    backend: Backend,
    sizes: list[int],
    direct_io: DirectIO,
    writer_count: int,
    stripe_count: int,
) -> None:
    extents = random_extents(sizes, seed=len(sizes) * 1000 + sizes[0])
    plan = _core.Plan(sizes, writer_count=writer_count, stripe_count=stripe_count, chunk_bytes=CHUNK)
    dirs = [tmp_path / f"stripe{i}" for i in range(stripe_count)]
    for d in dirs:
        d.mkdir()
    # More slots than writes in flight: chunks are also staged ahead while the queue is full.
    pool = _core.Pool(CHUNK, 12 * CHUNK)
    parts, reports = write_all(
        plan, extents, dirs, pool, backend=backend, direct_io=direct_io, queue_depth=4, durable=False
    )
    assert sum(r["bytes_written"] for r in reports) == plan.total_bytes
    assert len(parts) == len(plan.parts)
    can_direct = direct_io == "auto" and _core.direct_io_supported(tmp_path)
    for report in reports:
        assert report["backend"] == backend
        assert all(p["direct"] == can_direct for p in report["parts"])
        for part in report["parts"]:
            assert len(part["chunk_crc32c"]) == -(-part["len_bytes"] // CHUNK)

    dest = read_dest(plan.total_bytes)
    stats: dict[str, float] = {}
    got = read_whole(parts, dest, chunk_bytes=CHUNK, backend=backend, direct_io=direct_io, stats=stats)
    assert got == plan.total_bytes
    np.testing.assert_array_equal(dest[: plan.total_bytes], expected_stream(plan, extents))
    # The engine adds to the dict it is given, so one dict totals several reads.
    read_whole(parts, dest, chunk_bytes=CHUNK, backend=backend, direct_io=direct_io, stats=stats)
    assert stats["bytes"] == 2 * plan.total_bytes and stats["crc32c_s"] >= 0, stats


def test_any_buffer_is_a_source(tmp_path: Path, backend: Backend) -> None:
    sources: list[Any] = [b"abc", bytearray(b"defg"), memoryview(b"hi"), np.arange(5, dtype=np.int64)]
    plan = _core.Plan([3, 4, 2, 40], chunk_bytes=4096)
    (part,), _ = write_all(plan, sources, [tmp_path], _core.Pool(4096, 0), backend=backend)
    blob = Path(part[0]).read_bytes()
    assert blob[0:3] == b"abc" and blob[64:68] == b"defg" and blob[128:130] == b"hi"
    assert blob[192:232] == np.arange(5, dtype=np.int64).tobytes()
    assert blob[3:64] == bytes(61)  # gaps are zero


def test_one_job_writes_several_writers_parts(tmp_path: Path, backend: Backend) -> None:
    """also_writers: one job writes its own parts, then other writers' (a partner's copy made
    from identical state); the files and checksums equal those the writers make themselves."""
    sizes = [5 * CHUNK + 7, 3 * CHUNK, 11]
    extents = random_extents(sizes, seed=7)
    plan = _core.Plan(sizes, writer_count=3, chunk_bytes=CHUNK)
    pool = _core.Pool(CHUNK, 4 * CHUNK)
    alone, _ = write_all(plan, extents, [tmp_path], pool, backend=backend, durable=False)
    (tmp_path / "together").mkdir()
    order = [2, 0]
    parts = [p for w in order for p in plan.parts if p[0] == w]
    paths = [tmp_path / "together" / f"w{w}-s0.bin" for w, _, _, _ in parts]
    report = start_engine_write(plan, 2, paths, extents, pool, also_writers=[0], backend=backend, durable=False).wait()
    assert [p["path"] for p in report["parts"]] == [str(p) for p in paths]
    by_name = {Path(path).name: (Path(path).read_bytes(), crcs) for path, _, _, crcs in alone}
    for path, part in zip(paths, report["parts"], strict=True):
        assert (path.read_bytes(), part["chunk_crc32c"]) == by_name[path.name]
    with pytest.raises(ValueError, match="named twice"):
        start_engine_write(plan, 2, paths, extents, pool, also_writers=[0, 2])


def test_bad_arguments_raise_value_error(tmp_path: Path) -> None:
    plan = _core.Plan([8192], chunk_bytes=4096)
    pool = _core.Pool(4096, 0)
    data = np.zeros(8192, dtype=np.uint8)
    with pytest.raises(ValueError, match="C-contiguous"):
        start_engine_write(plan, 0, [tmp_path / "f"], [np.zeros(16384, np.uint8)[::2]], pool).wait()
    with pytest.raises(ValueError, match="parts but 2 paths"):
        start_engine_write(plan, 0, [tmp_path / "a", tmp_path / "b"], [data], pool).wait()
    # Inconsistencies the engine finds surface from wait(), like every other failure of the job.
    with pytest.raises(ValueError, match="source regions"):
        start_engine_write(plan, 0, [tmp_path / "f"], [data[:100]], pool).wait()
    with pytest.raises(ValueError, match="larger than the pool"):
        start_engine_write(_core.Plan([1], chunk_bytes=8192), 0, [tmp_path / "f"], [b"x"], pool).wait()
    with pytest.raises(ValueError, match="unknown backend"):
        start_engine_write(plan, 0, [tmp_path / "f"], [data], pool, backend="uring")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown direct_io"):
        start_engine_write(plan, 0, [tmp_path / "f"], [data], pool, direct_io="yes")  # type: ignore[arg-type]
    start_engine_write(plan, 0, [tmp_path / "f"], [data], pool).wait()
    with pytest.raises(ValueError, match="writable"):
        read_whole([(tmp_path / "f", 8192, 0, [])], bytes(8192), chunk_bytes=4096)
    with pytest.raises(ValueError, match="do not fit"):
        read_whole([(tmp_path / "f", 8192, 0, [])], bytearray(100), chunk_bytes=4096)


def test_the_null_sink_checksums_what_it_would_write_and_writes_nothing(tmp_path: Path) -> None:
    """The benchmark's null sink: the same staging and checksums as a real write, no bytes moved."""
    sizes = [5 * CHUNK + 7, 3 * CHUNK]
    extents = random_extents(sizes, seed=9)
    plan = _core.Plan(sizes, chunk_bytes=CHUNK)
    pool = _core.Pool(CHUNK, 4 * CHUNK)
    real = start_engine_write(plan, 0, [tmp_path / "real"], extents, pool).wait()
    null = start_engine_write(plan, 0, [tmp_path / "null"], extents, pool, backend="null").wait()
    assert null["backend"] == "null" and null["bytes_written"] == real["bytes_written"]
    assert null["parts"][0]["chunk_crc32c"] == real["parts"][0]["chunk_crc32c"]
    assert os.stat(tmp_path / "null").st_blocks == 0
    with pytest.raises(ValueError, match="null sink only takes writes"):
        read_whole(
            [(tmp_path / "real", plan.total_bytes, 0, [])],
            read_dest(plan.total_bytes),
            chunk_bytes=CHUNK,
            backend="null",
        )  # type: ignore[arg-type]
    code = "from fastpersist import _core; _core.select_backend()"
    env = dict(os.environ, FASTPERSIST_BACKEND="null")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "FASTPERSIST_BACKEND" in done.stderr


# --- checksums -----------------------------------------------------------------------------


def test_flipped_byte_raises_checksum_mismatch(tmp_path: Path, backend: Backend) -> None:
    nbytes = 5 * CHUNK + 123
    _, parts, _ = one_file(tmp_path, nbytes, backend)
    path = parts[0][0]
    position = 3 * CHUNK + 17
    with open(path, "r+b") as f:
        f.seek(position)
        old = f.read(1)
        f.seek(position)
        f.write(bytes([old[0] ^ 0x01]))
    with pytest.raises(fastpersist.ChecksumMismatchError) as caught:
        read_whole(parts, read_dest(nbytes), chunk_bytes=CHUNK, backend=backend)
    assert isinstance(caught.value, fastpersist.CorruptCheckpointError)
    message = str(caught.value)
    assert path in message
    assert f"[{3 * CHUNK}, {4 * CHUNK})" in message
    # Without recorded checksums the same read succeeds (verification is opt-in per part).
    unchecked: list[ReadPart] = [(p, n, o, []) for p, n, o, _ in parts]
    assert read_whole(unchecked, read_dest(nbytes), chunk_bytes=CHUNK, backend=backend) == nbytes


def test_truncated_file_is_corrupt(tmp_path: Path, backend: Backend) -> None:
    nbytes = 2 * CHUNK + 5
    _, parts, _ = one_file(tmp_path, nbytes, backend)
    path = parts[0][0]
    os.truncate(path, CHUNK + 1)
    with pytest.raises(fastpersist.CorruptCheckpointError) as caught:
        read_whole(parts, read_dest(nbytes), chunk_bytes=CHUNK, backend=backend)
    assert not isinstance(caught.value, fastpersist.ChecksumMismatchError)
    assert path in str(caught.value)
    assert str(nbytes) in str(caught.value) and str(CHUNK + 1) in str(caught.value)


class CallbackFailed(Exception):
    """An error of the caller's own, raised inside a job's callback."""


class FailingDevice:
    """A device hook whose copy (or wait) raises the caller's own error."""

    def __init__(self, fail: Callable[..., bool], where: str) -> None:
        arena = _core.Arena(1 << 20)
        lease = arena.try_lease()
        assert lease is not None
        self.lease = lease
        self.copy = fail if where == "copy" else lambda pieces: None
        self.wait = fail if where == "wait" else lambda: None


@pytest.mark.parametrize("callback", ["on_staged", "device.copy", "device.wait"])
def test_a_callbacks_exception_reaches_the_caller_as_itself(tmp_path: Path, backend: Backend, callback: str) -> None:
    raised = CallbackFailed(f"{callback} broke")

    def fail(*args: object) -> bool:
        raise raised

    plan = _core.Plan([3 * CHUNK], chunk_bytes=CHUNK)
    hooks = (
        JobHooks(guard=Guard(watched=[True], on_staged=fail))
        if callback == "on_staged"
        else JobHooks(device=FailingDevice(fail, callback.removeprefix("device.")))
    )
    sources = [np.ones(3 * CHUNK, np.uint8) if callback == "on_staged" else None]
    handle = start_engine_write(
        plan, 0, [tmp_path / "f"], sources, _core.Pool(CHUNK, 2 * CHUNK), backend=backend, background=True, hooks=hooks
    )
    with pytest.raises(CallbackFailed) as caught:
        handle.wait()
    assert caught.value is raised
    with pytest.raises(CallbackFailed) as again:  # every wait() raises the same error
        handle.wait()
    assert again.value is raised


def test_crc32c_matches_reference() -> None:
    assert _core.crc32c(b"") == 0
    assert _core.crc32c(b"123456789") == 0xE3069283
    assert _core.crc32c(np.zeros(32, dtype=np.uint8)) == 0x8A9136AA
    assert _core.crc32c(memoryview(b"\xff" * 32)) == 0x62A8AB43


# --- the GIL is released -------------------------------------------------------------------


@contextlib.contextmanager
def fast_gil_handoff() -> Iterator[None]:
    # A short switch interval makes a GIL-holding call show up as ~0 increments (the counter
    # would otherwise get up to one 5 ms interval around the call even when the GIL is held).
    previous = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


class Counter:
    """A pure-Python thread that counts as fast as it can get the GIL."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop:
            self.count += 1

    def __enter__(self) -> Counter:
        self._thread.start()
        while self.count == 0:
            time.sleep(0.001)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()


def counter_share(fn: Callable[[], object]) -> tuple[float, int, float]:
    """(share of its free-running rate the counter kept during `fn`, increments, seconds)."""
    with fast_gil_handoff(), Counter() as counter:
        before, start = counter.count, time.perf_counter()
        time.sleep(0.1)
        idle_rate = (counter.count - before) / (time.perf_counter() - start)
        before, start = counter.count, time.perf_counter()
        fn()
        increments, seconds = counter.count - before, time.perf_counter() - start
    return increments / (idle_rate * seconds), increments, seconds


def test_counter_detects_a_gil_holding_call() -> None:
    # Control: ndarray.tobytes() copies while holding the GIL; the counter must stall.
    big = np.ones(256 * MIB, dtype=np.uint8)
    share, increments, seconds = counter_share(lambda: big.tobytes())
    assert share < 0.2, (share, increments, seconds)


@pytest.mark.slow
def test_gil_released_during_blocking_write_and_read(tmp_path: Path, backend: Backend) -> None:
    nbytes = 256 * MIB
    data = np.full(nbytes, 7, dtype=np.uint8)
    plan = _core.Plan([nbytes], chunk_bytes=8 * MIB)
    pool = _core.Pool(8 * MIB, 64 * MIB)
    path = tmp_path / "big.bin"
    try:
        write = lambda: start_engine_write(  # noqa: E731
            plan, 0, [path], [data], pool, backend=backend, durable=True, background=False
        ).wait()
        share, increments, seconds = counter_share(write)
        assert increments > 1000 and share > 0.25, (share, increments, seconds)
        assert os.path.getsize(path) == nbytes

        dest = read_dest(nbytes)
        read = lambda: read_whole([(path, nbytes, 0, [])], dest, chunk_bytes=8 * MIB, backend=backend)  # noqa: E731
        share, increments, seconds = counter_share(read)
        assert increments > 1000 and share > 0.25, (share, increments, seconds)
        assert dest[0] == 7 and dest[nbytes - 1] == 7
    finally:
        path.unlink(missing_ok=True)


def test_gil_released_during_crc32c() -> None:
    big = np.ones(256 * MIB, dtype=np.uint8)
    share, increments, seconds = counter_share(lambda: [_core.crc32c(big) for _ in range(4)])
    assert increments > 1000 and share > 0.25, (share, increments, seconds)


# --- background writes: done, staged, cancel -----------------------------------------------


@pytest.fixture
def slow_path(tmp_path: Path) -> Iterator[Path]:
    """Where a slow write goes; removed afterwards (files are preallocated: keep /tmp small)."""
    path = tmp_path / "slow.bin"
    yield path
    path.unlink(missing_ok=True)


def slow_write(path: Path, backend: Backend, nbytes: int = 64 * MIB) -> tuple[_core.WriteHandle, np.ndarray]:
    """A background write throttled by a two-slot pool of 64 KiB slots at queue depth 2."""
    data = np.ones(nbytes, dtype=np.uint8)
    plan = _core.Plan([nbytes], chunk_bytes=CHUNK)
    pool = _core.Pool(CHUNK, 2 * CHUNK)
    handle = start_engine_write(plan, 0, [path], [data], pool, backend=backend, queue_depth=2, background=True)
    return handle, data


def test_background_write_reports_progress(slow_path: Path, backend: Backend) -> None:
    nbytes = 64 * MIB
    handle, _ = slow_write(slow_path, backend, nbytes)
    assert not handle.done()
    assert handle.backend == backend and handle.fallback_reason is None
    with pytest.raises(TimeoutError):
        handle.wait(timeout=0)
    handle.wait_staged(timeout=60)
    assert handle.staged()
    assert handle.bytes_staged == nbytes
    staged_seconds = handle.staged_seconds
    assert staged_seconds is not None
    report = handle.wait(timeout=60)
    assert handle.done()
    assert handle.bytes_written == report["bytes_written"] == nbytes
    assert report["staged_seconds"] == staged_seconds <= report["seconds"]
    assert os.path.getsize(slow_path) == nbytes
    assert handle.wait() == report  # waiting again returns the same report


def test_snapshot_pool_releases_sources_before_the_disk_is_done(slow_path: Path, backend: Backend) -> None:
    # With a pool as large as the state, staging is one memory copy that does not wait for the
    # disk: the pool grows past the writes in flight, and once staged the sources are free to
    # change while the writes go on. (How much sooner staging ends than the writes is a speed,
    # measured by benches/, not here: a timed assertion failed on a loaded machine.)
    if os.major(os.stat(slow_path.parent).st_dev) == 0:
        pytest.skip("the temporary directory is in memory (tmpfs): its writes go straight into the file's pages")
    nbytes = 64 * MIB
    (data,) = random_extents([nbytes])
    original = data.copy()
    plan = _core.Plan([nbytes], chunk_bytes=CHUNK)
    pool = _core.Pool(CHUNK, nbytes)
    handle = start_engine_write(plan, 0, [slow_path], [data], pool, backend=backend, queue_depth=2, background=True)
    handle.wait_staged(timeout=60)
    data[:] = 0  # the job staged every byte: it reads the sources no more
    report = handle.wait(timeout=60)
    assert report["staged_seconds"] is not None and report["staged_seconds"] <= report["seconds"]
    assert pool.allocated_bytes > 3 * CHUNK  # staged ahead of the two writes in flight
    dest = read_dest(nbytes)
    read_whole([(slow_path, nbytes, 0, report["parts"][0]["chunk_crc32c"])], dest, chunk_bytes=CHUNK)
    np.testing.assert_array_equal(dest[:nbytes], original)


def test_cancel_fails_with_save_cancelled(slow_path: Path, backend: Backend) -> None:
    handle, _ = slow_write(slow_path, backend, 256 * MIB)
    handle.cancel()
    with pytest.raises(fastpersist.SaveCancelledError, match="cancelled"):
        handle.wait(timeout=60)
    assert handle.done() and handle.staged()
    assert handle.bytes_staged < 256 * MIB


def test_dropping_a_running_handle_is_safe(slow_path: Path, backend: Backend) -> None:
    handle, data = slow_write(slow_path, backend, 16 * MIB)
    del handle  # waits for the job to stop reading `data` before releasing the export
    data[:] = 0  # the buffer is ours again


# --- errors keep errno and filename --------------------------------------------------------


def write_ten_bytes(path: Path, backend: Backend, direct_io: DirectIO) -> _core.WriteReport:
    plan = _core.Plan([10], chunk_bytes=4096)
    pool = _core.Pool(4096, 0)
    return start_engine_write(plan, 0, [path], [b"0123456789"], pool, backend=backend, direct_io=direct_io).wait()


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_missing_directory_is_file_not_found(tmp_path: Path, backend: Backend, direct_io: DirectIO) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError) as caught:
        write_ten_bytes(missing / "f.bin", backend, direct_io)
    assert caught.value.errno == errno.ENOENT
    assert caught.value.filename is not None and caught.value.filename.startswith(str(missing))
    with pytest.raises(FileNotFoundError) as read_caught:
        read_whole([(missing / "f.bin", 10, 0, [])], bytearray(10), chunk_bytes=4096, backend=backend)
    assert read_caught.value.filename == str(missing / "f.bin")


def test_read_only_filesystem(tmp_path: Path, backend: Backend) -> None:
    with mounted("tmpfs", tmp_path / "ro", "ro", "size=1m") as ro:
        for direct_io in ("auto", "off"):
            with pytest.raises(OSError) as caught:
                write_ten_bytes(ro / "f.bin", backend, direct_io)
            assert caught.value.errno in (errno.EROFS, errno.EACCES)
            assert caught.value.filename is not None and caught.value.filename.startswith(str(ro))


def test_direct_io_require_where_refused(tmp_path: Path, backend: Backend) -> None:
    with no_direct_fs(tmp_path / "mem") as mem:
        with pytest.raises(fastpersist.BackendUnavailableError, match="O_DIRECT"):
            one_file(mem, 10_000, backend, direct_io="require")
        data, parts, report = one_file(mem, 10_000, backend, direct_io="auto")
        assert [p["direct"] for p in report["parts"]] == [False]
        dest = read_dest(10_000)
        read_whole(parts, dest, chunk_bytes=CHUNK, backend=backend)
        np.testing.assert_array_equal(dest[:10_000], data)
        with pytest.raises(fastpersist.BackendUnavailableError):
            read_whole(parts, dest, chunk_bytes=CHUNK, backend=backend, direct_io="require")


def test_full_disk_is_enospc(tmp_path: Path, backend: Backend) -> None:
    with mounted("tmpfs", tmp_path / "small", "size=16m") as small:
        nbytes = 64 * MIB
        data = np.ones(nbytes, dtype=np.uint8)
        plan = _core.Plan([nbytes], chunk_bytes=MIB)
        pool = _core.Pool(MIB, 4 * MIB)
        target = small / "big.bin"
        with pytest.raises(OSError) as caught:
            start_engine_write(plan, 0, [target], [data], pool, backend=backend, queue_depth=4).wait()
        assert caught.value.errno == errno.ENOSPC
        assert caught.value.filename == str(target)
        assert "disk is full" in str(caught.value)
        # The process and the pool are fine: every slot came back, a new write succeeds.
        target.unlink()
        ok = tmp_path / "ok.bin"
        small_plan = _core.Plan([4 * MIB], chunk_bytes=MIB)
        handle = start_engine_write(
            small_plan, 0, [ok], [data[: 4 * MIB]], pool, backend=backend, queue_depth=4, background=True
        )
        assert handle.wait(timeout=30)["bytes_written"] == 4 * MIB
        assert pool.allocated_bytes <= pool.slot_count * pool.slot_bytes


def test_write_error_inside_the_backend_keeps_errno(backend: Backend) -> None:
    # /dev/full fails every write with ENOSPC: the error comes back through the backend's
    # completion path (ops in flight are drained), not from opening or preallocating.
    nbytes = 8 * MIB
    plan = _core.Plan([nbytes], chunk_bytes=MIB)
    pool = _core.Pool(MIB, 4 * MIB)
    data = np.ones(nbytes, dtype=np.uint8)
    with pytest.raises(OSError) as caught:
        start_engine_write(plan, 0, ["/dev/full"], [data], pool, backend=backend, direct_io="off", queue_depth=4).wait()
    assert caught.value.errno == errno.ENOSPC
    assert caught.value.filename == "/dev/full"
    # Every slot came back to the pool.
    handle = start_engine_write(
        plan, 0, ["/dev/null"], [data], pool, backend=backend, direct_io="off", durable=False, background=True
    )
    assert handle.wait(timeout=30)["bytes_written"] == nbytes


# --- durability helpers --------------------------------------------------------------------


def test_replace_atomically_new_and_exchange(tmp_path: Path) -> None:
    src, dst = tmp_path / "tmp-ckpt", tmp_path / "ckpt"
    src.mkdir()
    (src / "x").write_text("first")
    assert _core.replace_atomically(src, dst) is False
    assert (dst / "x").read_text() == "first" and not src.exists()
    src.mkdir()
    (src / "x").write_text("second")
    assert _core.replace_atomically(str(src), str(dst)) is True
    assert (dst / "x").read_text() == "second"
    assert (src / "x").read_text() == "first"  # the old tree, for the caller to remove
    _core.fsync_dir(tmp_path)
    _core.fsync_path(dst / "x")
    with pytest.raises(FileNotFoundError) as caught:
        _core.replace_atomically(tmp_path / "missing", tmp_path / "elsewhere")
    assert caught.value.errno == errno.ENOENT and caught.value.filename is not None
    with pytest.raises(FileNotFoundError):
        _core.fsync_path(tmp_path / "missing")
    with pytest.raises(FileNotFoundError):
        _core.fsync_dir(tmp_path / "missing")


# --- backend selection ---------------------------------------------------------------------

_SELECT_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import fastpersist
    from fastpersist import _core
    from fastpersist.engine import WriteRequest, start_write

    out = {"auto": _core.select_backend("auto")}
    try:
        out["io_uring"] = _core.select_backend("io_uring")
    except fastpersist.BackendUnavailableError as e:
        out["io_uring_error"] = str(e)
    plan = _core.Plan([10], chunk_bytes=4096)
    request = WriteRequest(plan=plan, paths=[sys.argv[1]], sources=[b"0123456789"], pool=_core.Pool(4096, 0))
    handle = start_write(request)
    out["handle"] = [handle.backend, handle.fallback_reason, handle.wait()["backend"]]
    print(json.dumps(out))
    """
)


def run_select(tmp_path: Path, **env: str) -> dict[str, Any]:
    child_env = {
        k: v for k, v in os.environ.items() if k not in ("FASTPERSIST_BACKEND", "FASTPERSIST_SIMULATE_URING_ERRNO")
    }
    child_env.update(env)
    done = subprocess.run(
        [sys.executable, "-c", _SELECT_SCRIPT, str(tmp_path / "f.bin")],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_env_forces_threads(tmp_path: Path) -> None:
    out = run_select(tmp_path, FASTPERSIST_BACKEND="threads")
    assert out["auto"] == ["threads", None]
    assert out["handle"] == ["threads", None, "threads"]
    if URING:  # an explicit choice is not overridden
        assert out["io_uring"] == ["io_uring", None]


@pytest.mark.parametrize(
    ("name", "cause", "fix"),
    [
        ("EPERM", "seccomp", "kernel.io_uring_disabled=0"),
        ("ENOSYS", "no io_uring", "kernel >= 5.6"),
        ("ENOMEM", "locked-memory limit", "ulimit -l"),
    ],
)
def test_blocked_uring_falls_back_loudly(tmp_path: Path, name: str, cause: str, fix: str) -> None:
    out = run_select(tmp_path, FASTPERSIST_SIMULATE_URING_ERRNO=name)
    backend, reason = out["auto"]
    assert backend == "threads"
    assert cause in reason and fix in reason
    assert "FASTPERSIST_BACKEND=threads" in reason
    assert "io_uring_error" in out and cause in out["io_uring_error"]
    assert out["handle"] == ["threads", reason, "threads"]
    # The same answer from the uncached probe, in this process.
    direct = _core.probe_uring(getattr(errno, name))
    assert direct is not None and cause in direct and fix in direct


def test_probe_uring_real_answer_matches_selection() -> None:
    assert (_core.probe_uring() is None) == URING


def test_env_is_validated_and_required_uring_fails_loudly(tmp_path: Path) -> None:
    code = "from fastpersist import _core; _core.select_backend()"
    env = dict(os.environ, FASTPERSIST_BACKEND="bogus")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "ValueError" in done.stderr and "FASTPERSIST_BACKEND" in done.stderr
    env = dict(os.environ, FASTPERSIST_BACKEND="io_uring", FASTPERSIST_SIMULATE_URING_ERRNO="EPERM")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "BackendUnavailableError" in done.stderr and "seccomp" in done.stderr
