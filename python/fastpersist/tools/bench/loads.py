"""The timed cold loads of ``fastpersist bench``: the drive's O_DIRECT read limits (into the same
buffer and into fresh memory at the load's settings, and into the same buffer at 64 MiB x 2),
``fastpersist.load``, ``torch.load`` and ``safetensors``.
"""

from __future__ import annotations

import inspect
import time
from typing import TYPE_CHECKING, Any

import fastpersist as fp

from ...engine import ReadRange, read_ranges
from ...loading.reading import aligned_uint8
from .measure import Method
from .saves import BIG_CHUNK_BYTES, BIG_QUEUE_DEPTH, settings_text

if TYPE_CHECKING:
    import torch

    from .harness import Bench


def add_load_methods(bench: Bench) -> None:
    """Adds the load rows and methods to `bench`; they read what the saves kept of their last repetition."""
    _add_engine_reads(bench)
    add_fastpersist_load(bench)
    add_torch_load(bench)
    add_safetensors_loads(bench)


def _add_engine_reads(bench: Bench) -> None:
    """The drive's read limits, of the engine limit's raw files: into warm memory and into fresh
    memory at the load's chunk size and depth, and into warm memory at 64 MiB x 2."""
    args = bench.args
    backend = bench.backends[0] if bench.backends else "threads"
    settings = settings_text(args.chunk_bytes, args.read_queue_depth)
    # No crc32c values to check: any chunk size reads any file.
    ranges = [
        ReadRange(p, n, 0, n, off, [])
        for p, (_w, _s, off, n) in zip(bench.raw_paths, bench.raw_plan.parts, strict=True)
    ]

    def read_into(dest: Any, chunk_bytes: int, queue_depth: int) -> None:
        got = read_ranges(
            ranges, dest, chunk_bytes=chunk_bytes, backend=backend, direct_io=bench.direct, queue_depth=queue_depth
        )
        assert got == bench.nbytes

    def warm_read(key: str, chunk_bytes: int, queue_depth: int) -> Method:
        def raw_read() -> dict[str, float]:
            start = time.perf_counter()
            read_into(bench.raw_buffer, chunk_bytes, queue_depth)
            return {key: time.perf_counter() - start}

        return Method(bench.rows[key].label, raw_read, [])

    raw_key = bench.add_row(
        "read_limit_engine", f"O_DIRECT read into warm memory (engine, {backend}, {settings})", "load", "limit"
    )
    bench.load_methods.append(warm_read(raw_key, args.chunk_bytes, args.read_queue_depth))
    fresh_key = bench.add_row(
        "read_fresh_engine", f"O_DIRECT read into fresh memory (engine, {backend}, {settings})", "load", "limit"
    )

    def raw_read_fresh() -> dict[str, float]:
        # What every load pays on top of the drive: the kernel faults in (zeroes) new pages.
        # Allocated as fastpersist.load allocates its buffer (huge pages where the OS allows).
        start = time.perf_counter()
        dest = aligned_uint8(bench.nbytes)
        read_into(dest.numpy(), args.chunk_bytes, args.read_queue_depth)
        seconds = time.perf_counter() - start
        del dest
        return {fresh_key: seconds}

    bench.load_methods.append(Method(bench.rows[fresh_key].label, raw_read_fresh, []))
    if (args.chunk_bytes, args.read_queue_depth) != (BIG_CHUNK_BYTES, BIG_QUEUE_DEPTH):
        big = settings_text(BIG_CHUNK_BYTES, BIG_QUEUE_DEPTH)
        big_key = bench.add_row(
            "read_limit_engine_64m", f"O_DIRECT read into warm memory (engine, {backend}, {big})", "load", "limit"
        )
        bench.load_methods.append(warm_read(big_key, BIG_CHUNK_BYTES, BIG_QUEUE_DEPTH))


def add_fastpersist_load(bench: Bench) -> None:
    """``fastpersist.load`` of what ``fastpersist.save`` on the first backend kept."""

    backend = bench.backends[0] if bench.backends else "threads"
    if bench.backends:
        fp_path = bench.path(f"fp-{bench.backends[0]}")
        fp_key = bench.add_row("fastpersist_load", "fastpersist.load", "load", "fastpersist")
        load_config = fp.Config(backend=backend, queue_depth=bench.args.read_queue_depth)

        def fp_load() -> dict[str, float]:
            phases: dict[str, float] = {}
            start = time.perf_counter()
            loaded = fp.load(fp_path, config=load_config, phases=phases)
            seconds = time.perf_counter() - start
            bench.loaded(fp_key, loaded)
            bench.load_phases.setdefault(fp_key, []).append(phases)
            return {fp_key: seconds}

        bench.load_methods.append(Method("fastpersist.load", fp_load, []))


def add_torch_load(bench: Bench) -> None:
    """``torch.load`` of what ``torch.save`` kept (``weights_only=False`` if the safe loader refuses)."""
    torch = bench.torch
    pt_path = bench.path("torch-save.pt")
    pt_key = bench.add_row("torch_load", "torch.load (weights_only)", "load", "peer")
    bench.weights_only = True

    def torch_load() -> dict[str, float]:
        start = time.perf_counter()
        try:
            loaded = torch.load(pt_path, weights_only=bench.weights_only, mmap=False)
        except Exception as e:
            if not bench.weights_only:
                raise
            bench.weights_only = False
            bench.rows[pt_key].label = "torch.load (weights_only=False)"
            bench.notes.append(f"torch.load(weights_only=True) refused the state ({e}); timed weights_only=False")
            bench.make_cold()
            start = time.perf_counter()
            loaded = torch.load(pt_path, weights_only=False, mmap=False)
        seconds = time.perf_counter() - start
        bench.loaded(pt_key, loaded)
        return {pt_key: seconds}

    bench.load_methods.append(Method("torch.load", torch_load, []))


def add_safetensors_loads(bench: Bench, *, pread: bool = True) -> None:
    """``safetensors.torch.load_file`` of what ``save_file`` kept: its default (mmap, every page
    touched) and, where this version has it and `pread` asks for it, ``backend="pread"``."""
    try:
        from safetensors.torch import load_file
    except ImportError:
        return
    st_path = bench.path("state.safetensors")
    mmap_key = bench.add_row("safetensors_load_mmap", "safetensors.load_file (mmap, pages touched)", "load", "peer")

    def st_load_mmap() -> dict[str, float]:
        # The default backend maps the file lazily: touching every page makes it a real load.
        start = time.perf_counter()
        loaded = load_file(st_path)
        _touch_pages(loaded)
        seconds = time.perf_counter() - start
        bench.loaded(mmap_key, loaded)
        return {mmap_key: seconds}

    bench.load_methods.append(Method("safetensors.load_file (mmap)", st_load_mmap, []))
    try:
        has_pread = "backend" in inspect.signature(load_file).parameters
    except (TypeError, ValueError):
        has_pread = False
    if pread and has_pread:
        pread_key = bench.add_row("safetensors_load_pread", "safetensors.load_file (pread)", "load", "peer")

        def st_load_pread() -> dict[str, float]:
            start = time.perf_counter()
            loaded = load_file(st_path, backend="pread")
            seconds = time.perf_counter() - start
            bench.loaded(pread_key, loaded)
            return {pread_key: seconds}

        bench.load_methods.append(Method("safetensors.load_file (pread)", st_load_pread, []))


def _touch_pages(tensors: dict[str, torch.Tensor]) -> int:
    """Reads one byte of every page of every tensor (materialises an mmap-backed load)."""
    import torch

    total = 0
    for t in tensors.values():
        if t.numel():
            u8 = t.reshape(-1).view(torch.uint8)
            total += int(u8[::4096].sum()) + int(u8[-1])
    return total
