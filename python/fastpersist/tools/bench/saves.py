"""The timed saves of ``fastpersist bench``: the drive's write limits (the engine's raw O_DIRECT
stream at the save's chunk size and depth and at 64 MiB x 2, and ``fio`` when installed),
``fastpersist.save``/``save_async``, and the peers (``torch.save``, ``safetensors``,
``torch.distributed.checkpoint``). Each one is durable.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import fastpersist as fp
import fastpersist._core as _core

from ...engine import WriteOptions, WriteRequest, start_write
from .fio import fio_engine, run_fio_write
from .measure import Method
from .system import Backend, aligned_buffer

if TYPE_CHECKING:
    from .harness import Bench


def add_save_methods(bench: Bench) -> None:
    """Adds the save rows and methods to `bench`, in the table's order: limits, fastpersist, peers."""
    _add_limit_methods(bench)
    _add_fastpersist_methods(bench)
    _add_peer_methods(bench)


#: The best single-stream O_DIRECT write of this VM's virtio disk was 64 MiB writes (3.1 GB/s against
#: 1.8 GB/s at 8 MiB): the limit rows include the raw write at this chunk size, two in flight.
BIG_CHUNK_BYTES = 64 << 20
BIG_QUEUE_DEPTH = 2


def settings_text(chunk_bytes: int, queue_depth: int) -> str:
    """``"4 MiB x 8"``: a chunk size and a queue depth, as the limit rows' labels name them."""
    return f"{chunk_bytes / 2**20:g} MiB x {queue_depth}"


def _add_limit_methods(bench: Bench) -> None:
    """The drive's write limits: the engine's raw O_DIRECT write of the state's bytes at the save's
    chunk size and depth, at 64 MiB x 2 (unless that is the save's chunk size), and fio."""
    args = bench.args
    backend = bench.backends[0]
    bench.raw_buffer = aligned_buffer(bench.nbytes)
    bench.raw_plan = _core.Plan([bench.nbytes], 1, len(bench.dirs), args.chunk_bytes)
    bench.raw_paths = [bench.path(f"raw-limit-s{stripe}.bin", stripe) for _w, stripe, _o, _n in bench.raw_plan.parts]
    settings = settings_text(args.chunk_bytes, args.queue_depth)
    key = bench.add_row(
        "write_limit_engine", f"O_DIRECT write limit (engine, {backend}, {settings} as the save)", "save", "limit"
    )
    raw_pool = _core.Pool(args.chunk_bytes, args.pool_bytes)
    # Its files are kept: the engine's read limits read them back.
    bench.save_methods.append(
        _raw_write(bench, key, bench.raw_plan, bench.raw_paths, raw_pool, args.queue_depth, keep_last=True)
    )
    if args.chunk_bytes != BIG_CHUNK_BYTES:
        big_key = bench.add_row(
            "write_limit_engine_64m",
            f"O_DIRECT write limit (engine, {backend}, {settings_text(BIG_CHUNK_BYTES, BIG_QUEUE_DEPTH)})",
            "save",
            "limit",
        )
        big_plan = _core.Plan([bench.nbytes], 1, len(bench.dirs), BIG_CHUNK_BYTES)
        big_paths = [bench.path(f"raw-limit-64m-s{stripe}.bin", stripe) for _w, stripe, _o, _n in big_plan.parts]
        big_pool = _core.Pool(BIG_CHUNK_BYTES, BIG_QUEUE_DEPTH * BIG_CHUNK_BYTES)
        bench.save_methods.append(_raw_write(bench, big_key, big_plan, big_paths, big_pool, BIG_QUEUE_DEPTH))
    _add_fio_method(bench)


def _raw_write(
    bench: Bench,
    key: str,
    plan: _core.Plan,
    paths: list[str],
    pool: _core.Pool,
    queue_depth: int,
    *,
    keep_last: bool = False,
) -> Method:
    """The engine's raw write of the state's bytes (no checksum, fsynced) along `plan`, timed as row `key`."""
    backend = bench.backends[0]
    source = bench.raw_buffer[: bench.nbytes]

    def raw_write() -> dict[str, float]:
        start = time.perf_counter()
        request = WriteRequest(
            plan=plan,
            paths=paths,
            sources=[source],
            pool=pool,
            options=WriteOptions(
                backend=backend, direct_io=bench.direct, queue_depth=queue_depth, checksum=False, durable=True
            ),
        )
        report = start_write(request).wait()
        seconds = time.perf_counter() - start
        assert report["bytes_written"] == bench.nbytes
        return {key: seconds}

    return Method(bench.rows[key].label, raw_write, list(paths), keep_last)


def _add_fio_method(bench: Bench) -> None:
    """fio's O_DIRECT write of the state's byte count (8 MiB x iodepth 8), where it is installed."""
    args = bench.args
    if args.no_fio or shutil.which("fio") is None:
        why = "--no-fio" if args.no_fio else "the fio binary is not installed"
        bench.notes.append(f"fio: skipped ({why}); the write limit is the faster of the engine's raw O_DIRECT writes")
        return
    engine = fio_engine()
    fio_key = bench.add_row("write_limit_fio", f"fio write ({engine}, O_DIRECT, 8 MiB x 8)", "save", "limit")
    fio_paths = [bench.path(f"fio-s{i}.bin", i) for i in range(len(bench.dirs))]
    bench.fio_raw = []

    def fio_write() -> dict[str, float]:
        bs = 8 << 20
        run = run_fio_write(fio_paths, -(-bench.nbytes // len(fio_paths)), block_bytes=bs, iodepth=8)
        bench.fio_raw.append({"io_bytes": run.io_bytes, "runtime_s": run.runtime_s})
        # fio's own clock (no process start-up), scaled to the state's byte count
        return {fio_key: run.runtime_s * bench.nbytes / run.io_bytes}

    bench.save_methods.append(Method("fio write", fio_write, fio_paths))


def _add_fastpersist_methods(bench: Bench) -> None:
    for backend in bench.backends:
        add_fastpersist_save(bench, backend)
    if not bench.backends:
        return
    add_save_async(bench)
    _add_fastpersist_torch_save(bench)


def add_fastpersist_save(bench: Bench, backend: Backend) -> None:
    """``fastpersist.save`` on `backend`; its checkpoint is kept for ``fastpersist.load``."""

    config = fp.Config(backend=backend, **bench.config_kwargs)
    path = bench.path(f"fp-{backend}")
    key = bench.add_row(f"fastpersist_save_{backend}", f"fastpersist.save ({backend})", "save", "fastpersist")

    def save() -> dict[str, float]:
        start = time.perf_counter()
        result = fp.save(bench.state, path, config=config)
        seconds = time.perf_counter() - start
        bench.save_phases.setdefault(key, []).append(result.phases)
        return {key: seconds}

    bench.save_methods.append(Method(f"fastpersist.save ({backend})", save, [path], keep_last=True))


def add_save_async(bench: Bench) -> None:
    """``fastpersist.save_async``: three rows, the time to return, to staged and to durable."""

    async_config = fp.Config(**bench.config_kwargs)
    path = bench.path("fp-async")
    mode = "snapshot" if bench.args.pool_bytes >= bench.nbytes else "bounded"
    k_ret = bench.add_row(
        "fastpersist_save_async_return", "fastpersist.save_async: return", "save", "fastpersist", rate=False
    )
    k_staged = bench.add_row(
        "fastpersist_save_async_staged", f"fastpersist.save_async: staged ({mode})", "save", "fastpersist"
    )
    k_done = bench.add_row("fastpersist_save_async_durable", "fastpersist.save_async: durable", "save", "fastpersist")

    def save_async() -> dict[str, float]:
        start = time.perf_counter()
        fut = fp.save_async(bench.state, path, config=async_config)
        returned = time.perf_counter()
        fut.wait_staged()
        staged = time.perf_counter()
        fut.wait()
        durable = time.perf_counter()
        return {k_ret: returned - start, k_staged: staged - start, k_done: durable - start}

    bench.save_methods.append(Method("fastpersist.save_async", save_async, [path]))


def _add_fastpersist_torch_save(bench: Bench) -> None:
    ts_path = bench.path("fp-torch-save.pt")
    ts_key = bench.add_row("fastpersist_torch_save", "fastpersist.torch_save (.pt)", "save", "fastpersist")
    ts_config = fp.Config(**bench.config_kwargs)

    def torch_save_fp() -> dict[str, float]:
        start = time.perf_counter()
        fp.torch_save(bench.state, ts_path, config=ts_config)
        return {ts_key: time.perf_counter() - start}

    bench.save_methods.append(Method("fastpersist.torch_save", torch_save_fp, [ts_path]))
    _add_export_method(bench, fp.Config(**bench.config_kwargs))


def _add_export_method(bench: Bench, config: Any) -> None:
    """``fastpersist.export_hf`` of the whole state from a checkpoint of it (saved once, untimed)
    to Hugging Face safetensors shards: read back, checksummed, written, fsynced; against
    ``safetensors.save_file`` of the same tensors from memory."""

    src, out = bench.path("fp-export-src"), bench.path("hf-export")
    key = bench.add_row("fastpersist_export_hf", "fastpersist.export_hf (from a checkpoint)", "save", "fastpersist")

    def export() -> dict[str, float]:
        if not os.path.exists(src):
            fp.save(bench.state, src, config=config)
        start = time.perf_counter()
        fp.export_hf(src, out, config=config)
        return {key: time.perf_counter() - start}

    bench.save_methods.append(Method("fastpersist.export_hf", export, [out]))


def _add_peer_methods(bench: Bench) -> None:
    add_torch_save(bench)
    add_safetensors_save(bench)
    _add_dcp_methods(bench)


def add_torch_save(bench: Bench) -> None:
    """``torch.save`` + fsync; its file is kept for ``torch.load``."""
    torch = bench.torch
    path = bench.path("torch-save.pt")
    key = bench.add_row("torch_save", "torch.save + fsync", "save", "peer")

    def torch_save() -> dict[str, float]:
        start = time.perf_counter()
        torch.save(bench.state, path)
        _core.fsync_path(path)
        return {key: time.perf_counter() - start}

    bench.save_methods.append(Method("torch.save + fsync", torch_save, [path], keep_last=True))


def add_safetensors_save(bench: Bench) -> None:
    """``safetensors.torch.save_file`` + fsync (a note where safetensors is missing); its file is kept."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        bench.notes.append("safetensors is not installed (pip install safetensors): its rows are skipped")
        return
    path = bench.path("state.safetensors")
    key = bench.add_row("safetensors_save", "safetensors.save_file + fsync", "save", "peer")

    def st_save() -> dict[str, float]:
        start = time.perf_counter()
        save_file(bench.safetensors_dict, path, metadata=bench.safetensors_meta)
        _core.fsync_path(path)
        return {key: time.perf_counter() - start}

    bench.save_methods.append(Method("safetensors.save_file + fsync", st_save, [path], keep_last=True))


def _add_dcp_methods(bench: Bench) -> None:
    try:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save_state
    except ImportError as e:
        bench.notes.append(f"torch.distributed.checkpoint unavailable ({e}): its rows are skipped")
        return
    if not _dcp_works(bench, dcp_save_state, FileSystemWriter):
        return
    for threads in (1, 4):
        path = bench.path(f"dcp-t{threads}")
        key = bench.add_row(
            f"dcp_save_t{threads}", f"DCP FileSystemWriter ({threads} thread{'s' * (threads > 1)})", "save", "peer"
        )

        def dcp_save(path: str = path, key: str = key, threads: int = threads) -> dict[str, float]:
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                writer = FileSystemWriter(path, thread_count=threads, sync_files=True)
                dcp_save_state(bench.state, storage_writer=writer)
            return {key: time.perf_counter() - start}

        bench.save_methods.append(Method(f"DCP ({threads} thread{'s' * (threads > 1)})", dcp_save, [path]))


def _dcp_works(bench: Bench, dcp_save_state: Callable[..., Any], writer_cls: Any) -> bool:
    """Tries a tiny DCP save; initialises a 1-process gloo group if DCP insists on one."""
    import torch.distributed as dist

    probe_dir = bench.path("dcp-probe")
    tiny = {"w": bench.torch.zeros(4), "step": 1}
    for attempt in range(2):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp_save_state(tiny, storage_writer=writer_cls(probe_dir, thread_count=1, sync_files=True))
            return True
        except Exception as e:
            if attempt or dist.is_initialized():
                bench.notes.append(f"torch.distributed.checkpoint failed here ({e}); its rows are skipped")
                return False
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            dist.init_process_group("gloo", rank=0, world_size=1)
            bench.notes.append("DCP needed a process group: initialised gloo, world size 1")
        finally:
            shutil.rmtree(probe_dir, ignore_errors=True)
    return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
