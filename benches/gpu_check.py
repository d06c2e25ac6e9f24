"""One-shot GPU check: what fastpersist does with a GPU training state, measured (docs/gpu.md).

scripts/gpu_check.sh runs it on a machine with one NVIDIA GPU. Each section prints its lines as
soon as they are measured (a stage cut short by its timeout keeps what it printed):

1. round trip: a mixed-precision Adam state of the size asked (bf16 weights with a tied LM head,
   fp32 master weights and moments of a real ``torch.optim.AdamW``, CPU step counters), nearly
   all its bytes in tensors above the 1 MiB early-copy bound, which the side-stream copier stages.
   ``optimizer.step()`` is queued behind GPU work, ``save_async`` is called at once (the copies
   must wait for the step), the next forward updates BatchNorm buffers in place; the checkpoint
   is compared tensor by tensor, optimizer state included, loaded to the host, loaded to the
   device, and loaded into a fresh optimizer.
2. device-to-host: fastpersist's staging (``save_async`` until ``wait_staged``, the default
   Config) against a plain copy of the same tensors into one reused pinned buffer, with
   checksums off and on (target 1.3x); every repetition's ``save_async`` return time, and the
   arena and pinned bytes held.
3. load to the device: fastpersist against ``torch.load(map_location=...)`` (page cache
   dropped first) and fastpersist's host load + ``.to()``; device and host memory growth.
4. save GB/s from the device, from host memory and torch.save + fsync; device memory growth;
   ``fp.torch_save`` and ``dcp.save(storage_writer=FastPersistWriter)`` from the device against
   ``fp.save`` (target 0.8x).
5. the staging targets (benches/gpu_targets.py, within ``--targets-s``): synthetic 1, 4 and
   12 GiB states against a plain pinned copy; a GPT-2 training loop's time lost per checkpoint
   with the README recipe against a plain pinned copy, and a copy every step; pinned memory
   over 100 saves.
6. overlap: training iterations with one warmed Checkpointer(every=N), N chosen so that a save
   fits within N iterations (it measures the overlap, not the disk), against the same loop
   without checkpoints.

``--device cpu`` is a smoke mode that runs every section on the CPU (no pinned memory; its
figures mean nothing): the dry run of scripts/gpu_check.sh and CI use it to check the script.

Run: ``python benches/gpu_check.py --size 512MiB --dir /data`` (checkpoints in /data/bench).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any, Literal

import gpu_targets  # benches/gpu_targets.py, beside this script
import torch

import fastpersist as fp
from fastpersist import _core
from fastpersist.gpu.copiers import device_bytes
from fastpersist.integrations import guard_optimizer
from fastpersist.tools.bench.state import build_state
from fastpersist.tools.units import parse_size

MiB = 1 << 20
#: Tensors of at most this many bytes are copied on the device before save_async returns
#: (fastpersist/gpu/early.py); the GPT shape below keeps most of the state above it.
EARLY_COPY_MAX_BYTES = 1 << 20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _times_s(fn: Callable[[], object], device: torch.device, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def _median_s(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    return statistics.median(_times_s(fn, device, reps))


def _tree_map(node: Any, fn: Callable[[torch.Tensor], torch.Tensor], memo: dict[int, torch.Tensor]) -> Any:
    """`node` with every tensor replaced by fn(tensor); a tensor reached twice maps to one result."""
    if isinstance(node, torch.Tensor):
        if id(node) not in memo:
            memo[id(node)] = fn(node)
        return memo[id(node)]
    if isinstance(node, dict):
        return {k: _tree_map(v, fn, memo) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_tree_map(v, fn, memo) for v in node)
    return node


def _device_sources(state: object, device: torch.device) -> list[torch.Tensor]:
    """One 1-D uint8 view per storage of `state` on `device` (tied tensors once)."""
    seen: set[int] = set()
    out = []
    for t in gpu_targets.tensors_of(state):
        if t.device == device and t.numel() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out.append(device_bytes(t))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values as bytes: NaNs compare equal to themselves, -0.0 differs from 0.0."""
    return t.reshape(-1).view(torch.uint8)


def mismatches(got: Any, want: Any, path: str = "state") -> list[str]:
    """Key paths where `got` differs from `want` (type, dtype, shape, device type or any bit)."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or (got.dtype, got.shape) != (want.dtype, want.shape):
            return [path]
        return [] if torch.equal(_bits(got.to(want.device)), _bits(want)) else [path]
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [path]
        return [m for k in want for m in mismatches(got[k], want[k], f"{path}.{k}")]
    if isinstance(want, (list, tuple)):
        if type(got) is not type(want) or len(got) != len(want):
            return [path]
        return [m for i, (g, w) in enumerate(zip(got, want, strict=True)) for m in mismatches(g, w, f"{path}.{i}")]
    return [] if got == want else [path]


class TrainingState:
    """A GPT-shaped mixed-precision Adam state of `nbytes` on `device` with a real optimizer.

    The shapes and values come from ``fastpersist bench``'s state (14 bytes per parameter); the
    fp32 masters are the parameters of a ``torch.optim.AdamW`` holding the moments, and the bf16
    weights (the LM head tied to the embedding) are refreshed from the masters after each step.
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        cpu = build_state(nbytes, min_layers=4)  # tensors of several MiB at 512 MiB
        opt_cpu = cpu["optimizer"]
        self.device = device
        self.model: dict[str, torch.Tensor] = _tree_map(cpu["model"], lambda t: t.to(device), {})
        self.masters = [t.to(device).requires_grad_() for t in opt_cpu.pop("fp32_master")]
        group = opt_cpu["param_groups"][0]
        self.opt = torch.optim.AdamW(
            self.masters, lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"]
        )
        self.opt.load_state_dict(opt_cpu)  # moves the moments to the masters' device
        self.names = [n for n in self.model if n != "lm_head.weight"]  # one per master, in order
        self.extras = {k: v for k, v in cpu.items() if k not in ("model", "optimizer")}
        self.bn = torch.nn.BatchNorm1d(256).to(device)
        self.bn_input = torch.randn(64, 256, device=device)
        self.nbytes = sum(t.nbytes for t in _unique(self.state()))

    def step(self) -> None:
        """Queues one optimizer step and the bf16 refresh (asynchronous on a GPU)."""
        for p in self.masters:
            p.grad = torch.randn_like(p).mul_(1e-3)
        self.opt.step()
        with torch.no_grad():
            for name, p in zip(self.names, self.masters, strict=True):
                self.model[name].copy_(p)

    def forward(self) -> None:
        """The next forward: updates the BatchNorm buffers in place."""
        self.bn(self.bn_input)

    def state(self) -> dict[str, Any]:
        opt = self.opt.state_dict()
        opt["fp32_master"] = [p.detach() for p in self.masters]
        return {"model": self.model, "optimizer": opt, "bn": self.bn.state_dict(), **self.extras}


def _unique(state: object) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in gpu_targets.tensors_of(state):
        if t.data_ptr() not in seen or not t.numel():
            seen.add(t.data_ptr())
            out.append(t)
    return out


def _busy(device: torch.device, ms: float) -> None:
    """Queues about `ms` of matrix products on the current stream (on a CPU: runs them)."""
    n = 4096 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    _sync(device)
    start = time.perf_counter()
    torch.mm(a, b)
    _sync(device)
    each_ms = max((time.perf_counter() - start) * 1e3, 1e-3)
    for _ in range(min(1000, max(1, math.ceil(ms / each_ms)))):
        torch.mm(a, b)


def check_round_trip(ts: TrainingState, root: str) -> bool:
    device = ts.device
    path = os.path.join(root, "round-trip")
    state = ts.state()
    big = [t for t in _unique(state) if t.device == device and t.nbytes > EARLY_COPY_MAX_BYTES]
    print(
        f"state: {ts.nbytes / MiB:.0f} MiB in {len(_unique(state))} tensors; {len(big)} on {device} above the "
        f"early-copy bound ({sum(t.nbytes for t in big) / MiB:.0f} MiB: staged by the copier)"
    )
    _busy(device, 200)
    ts.step()  # queued behind the products: the save's copies must see its results
    start = time.perf_counter()
    fut = fp.save_async(ts.state(), path)
    returned_s = time.perf_counter() - start
    queued = "n/a" if device.type != "cuda" else not torch.cuda.current_stream(device).query()
    expected = _tree_map(ts.state(), lambda t: t.clone(), {})  # stream-ordered after the step
    ts.forward()  # in place, on buffers the early copy took before save_async returned
    fut.wait()
    print(f"save_async returned in {returned_s * 1e3:.1f} ms; the step was still queued then: {queued}")
    ok = True
    for where in ("cpu", device):
        loaded = fp.load(path, map_location=where)
        bad = mismatches(loaded, expected)
        on = {t.device.type for t in gpu_targets.tensors_of(loaded["model"])}
        ok = ok and not bad and on == {torch.device(where).type}
        print(f"round trip, loaded to {where}: {'ok' if not bad else 'MISMATCH ' + ', '.join(bad[:8])} (model on {on})")
    loaded = fp.load(path, map_location=device)
    fresh = torch.optim.AdamW([torch.zeros_like(p, requires_grad=True) for p in ts.masters])
    opt = dict(loaded["optimizer"])
    del opt["fp32_master"]
    fresh.load_state_dict(opt)
    want = {k: v for k, v in expected["optimizer"].items() if k != "fp32_master"}
    bad = mismatches(fresh.state_dict(), want, "optimizer")
    ok = ok and not bad
    print(f"optimizer state loaded into a fresh AdamW: {'ok' if not bad else 'MISMATCH ' + ', '.join(bad[:8])}")
    return ok


def check_staging(ts: TrainingState, root: str, reps: int) -> None:
    """``save_async`` until ``wait_staged()`` with the default Config, against a plain copy of the
    same tensors into one reused pinned buffer (one ``copy_`` each, then a synchronize): the
    target is 1.3x (docs/gpu.md)."""
    device = ts.device
    state = ts.state()
    sources = _device_sources(state, device)
    nbytes = sum(s.numel() for s in sources)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dsts = list(host.split_with_sizes([src.numel() for src in sources]))

    def plain() -> None:
        for src, dst in zip(sources, dsts, strict=True):
            dst.copy_(src, non_blocking=True)

    plain()  # first touch of the host buffer
    plain_s = _median_s(plain, device, reps)
    print(
        f"device-to-host, {nbytes / MiB:.0f} MiB in {len(sources)} {device} tensors: plain pinned copy "
        f"{plain_s * 1e3:.1f} ms ({nbytes / 1e9 / plain_s:.1f} GB/s)"
    )
    _compare_copy_calls(plain, sources, dsts, device, reps)
    checksums: tuple[Literal["off", "crc32c"], ...] = ("off", "crc32c")
    for checksum in checksums:
        config = fp.Config(checksum=checksum)  # the default Config otherwise
        fp.save_async(state, os.path.join(root, "staging"), config=config).wait()  # makes (and pins) the arena
        returned, staged = [], []
        for _ in range(reps):
            _sync(device)
            start = time.perf_counter()
            fut = fp.save_async(state, os.path.join(root, "staging"), config=config)
            returned.append(time.perf_counter() - start)
            fut.wait_staged()
            staged.append(time.perf_counter() - start)
            fut.wait()
        staged_s = statistics.median(staged)
        print(
            f"  checksum {checksum}: save_async -> wait_staged {staged_s * 1e3:.1f} ms = {staged_s / plain_s:.2f}x "
            f"the plain copy (target <= 1.3x); save_async returned in "
            f"{', '.join(f'{r * 1e3:.1f}' for r in returned)} ms; arenas {fp.gpu.arena_bytes() / MiB:.0f} MiB, "
            f"pinned {fp.gpu.pinned_bytes() / MiB:.0f} MiB"
        )


def _compare_copy_calls(
    loop: Callable[[], None], sources: list[torch.Tensor], dsts: list[torch.Tensor], device: torch.device, reps: int
) -> None:
    """How long queueing the copies takes: `loop`, one ``copy_`` per tensor from Python (what
    ``CudaCopier`` does), against one ``torch._foreach_copy_`` call from `sources` into `dsts`,
    which crosses into C++ once (for a device-to-host list it still copies tensor by tensor
    there, pytorch#111351)."""

    def foreach() -> None:
        torch._foreach_copy_(dsts, sources, non_blocking=True)

    queued: dict[str, list[float]] = {"loop": [], "foreach": []}
    total: dict[str, list[float]] = {"loop": [], "foreach": []}
    for _ in range(reps):
        for name, fn in (("loop", loop), ("foreach", foreach)):
            _sync(device)
            start = time.perf_counter()
            fn()
            queued[name].append(time.perf_counter() - start)
            _sync(device)
            total[name].append(time.perf_counter() - start)
    same = all(torch.equal(dst, src.cpu()) for src, dst in zip(sources, dsts, strict=True))
    ms = {name: (statistics.median(queued[name]) * 1e3, statistics.median(total[name]) * 1e3) for name in queued}
    print(
        f"  queueing {len(sources)} copies: copy_ per tensor {ms['loop'][0]:.2f} ms (landed {ms['loop'][1]:.1f} ms), "
        f"one _foreach_copy_ {ms['foreach'][0]:.2f} ms (landed {ms['foreach'][1]:.1f} ms); bytes equal: {same}"
    )


def check_save(ts: TrainingState, root: str, reps: int) -> None:
    device = ts.device
    state = ts.state()
    gb = ts.nbytes / 1e9
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    t_dev = _median_s(lambda: fp.save(state, os.path.join(root, "from-device")), device, reps)
    growth = torch.cuda.max_memory_allocated(device) - before if cuda else None
    host = _tree_map(state, lambda t: t.cpu(), {})
    t_host = _median_s(lambda: fp.save(host, os.path.join(root, "from-host")), device, reps)

    def torch_save() -> None:
        with open(os.path.join(root, "torch.pt"), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    t_torch = _median_s(torch_save, device, reps)
    shown = "n/a" if growth is None else f"{growth / MiB:.1f} MiB"
    print(
        f"save {ts.nbytes / MiB:.0f} MiB: from {device} {gb / t_dev:.2f} GB/s, same bytes from host memory "
        f"{gb / t_host:.2f} GB/s (device / host = {t_host / t_dev:.2f}x), torch.save+fsync {gb / t_torch:.2f} GB/s; "
        f"device memory growth during a save: {shown}"
    )
    t_fp_torch = _median_s(lambda: fp.torch_save(state, os.path.join(root, "fp.pt")), device, reps)
    print(
        f"  fp.torch_save from {device}: {gb / t_fp_torch:.2f} GB/s = {t_dev / t_fp_torch:.2f}x fp.save "
        "(target >= 0.8x)"
    )
    try:
        import torch.distributed.checkpoint as dcp

        from fastpersist.integrations.dcp import FastPersistWriter

        flat = {f"t{i}": t for i, t in enumerate(_unique(state))}
        t_dcp = _median_s(
            lambda: dcp.save(flat, storage_writer=FastPersistWriter(os.path.join(root, "dcp"), overwrite=True)),
            device,
            reps,
        )
        print(
            f"  dcp.save(FastPersistWriter) from {device}: {gb / t_dcp:.2f} GB/s = {t_dev / t_dcp:.2f}x fp.save "
            "(target >= 0.8x)"
        )
    except Exception as e:  # a figure, not a check: say why it is missing
        print(f"  dcp.save(FastPersistWriter): not measured ({type(e).__name__}: {e})")


def _drop_cache(path: str) -> None:
    """Evicts a file's clean pages, so that torch.load reads the disk as O_DIRECT does."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _host_peak_growth(fn: Callable[[], object]) -> int | None:
    """Peak RSS growth of `fn` in bytes (resets VmHWM through /proc/self/clear_refs), or None."""

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith(field))
        return int(line.split()[1]) * 1024

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = status("VmRSS")
        fn()
        return status("VmHWM") - before
    except OSError:
        fn()
        return None


def check_load(ts: TrainingState, root: str, reps: int) -> bool:
    device = ts.device
    state = ts.state()
    path, pt = os.path.join(root, "load"), os.path.join(root, "load.pt")
    fp.save(state, path)
    with open(pt, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    where = str(device)
    bad = mismatches(fp.load(path, map_location=where), state)
    print(f"load to map_location={where!r}: {'ok' if not bad else 'MISMATCH ' + ', '.join(bad[:8])}")

    def torch_load() -> object:
        _drop_cache(pt)
        return torch.load(pt, map_location=where, weights_only=True)

    def host_then_to() -> object:
        return _tree_map(fp.load(path, map_location="cpu"), lambda t: t.to(device), {})

    t_fp = _median_s(lambda: fp.load(path, map_location=where), device, reps)
    t_torch = _median_s(torch_load, device, reps)
    t_host = _median_s(host_then_to, device, reps)
    gpu = "n/a"
    if device.type == "cuda":
        on_device = sum(t.nbytes for t in _unique(state) if t.device == device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        host_growth = _host_peak_growth(lambda: fp.load(path, map_location=where))
        torch.cuda.synchronize(device)
        gpu = f"{(torch.cuda.max_memory_allocated(device) - before - on_device) / MiB:.1f} MiB"
    else:
        host_growth = _host_peak_growth(lambda: fp.load(path, map_location=where))
    gb = ts.nbytes / 1e9
    rss = "n/a" if host_growth is None else f"{host_growth / MiB:.0f} MiB"
    print(
        f"load {ts.nbytes / MiB:.0f} MiB to {where}: fastpersist {gb / t_fp:.2f} GB/s, "
        f"torch.load(map_location={where!r}) {gb / t_torch:.2f} GB/s, fastpersist host load + .to() "
        f"{gb / t_host:.2f} GB/s; device memory beyond the state during a load: {gpu}; host peak RSS growth: {rss}"
    )
    return not bad


class _Training:
    """A stack of fp32 Linear layers trained with AdamW: a state of about `nbytes` (weights and
    two moments, 12 bytes per parameter) and real compute per iteration."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        width = 2048 if device.type == "cuda" else 256
        layers = max(1, nbytes // 12 // (width * width))
        self.device = device
        self.model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters())
        self.x = torch.randn(1024 if device.type == "cuda" else 64, width, device=device)

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}

    def run(self, steps: range, ck: fp.Checkpointer | None) -> float:
        """Seconds for `steps` iterations, each followed by ``ck.save`` when given."""
        _sync(self.device)
        start = time.perf_counter()
        for step in steps:
            self.model(self.x).square().mean().backward()
            self.opt.step()
            self.opt.zero_grad()
            if ck is not None:
                ck.save(step, self.state())
        _sync(self.device)
        return time.perf_counter() - start


def check_overlap(nbytes: int, device: torch.device, root: str, reps: int) -> None:
    training = _Training(nbytes, device)
    training.run(range(2), None)  # creates the AdamW moments
    iter_s = statistics.median(training.run(range(1), None) for _ in range(5))
    save_s = _median_s(lambda: fp.save(training.state(), os.path.join(root, "overlap-alone")), device, 2)
    every = max(1, math.ceil(1.5 * save_s / iter_s))  # a save finishes well within its interval
    ck = fp.Checkpointer(os.path.join(root, "overlap"), every=every, keep=1)
    handle = guard_optimizer(training.opt, ck)
    training.run(range(1), ck)  # warms it: the Checkpointer's pool is allocated (and pinned) here
    ck.wait()
    # Each repetition runs 4 * every iterations; a slow disk makes `every` large: keep to ~60 s.
    reps = max(1, min(reps, int(60 / (4 * every * iter_s))))
    base, with_ck = [], []
    for rep in range(reps):
        base.append(training.run(range(2 * every), None))
        first = (2 * rep + 1) * every
        with_ck.append(training.run(range(first, first + 2 * every), ck))  # two saves
        ck.wait()
    handle.remove()
    ck.close()
    state_mib = sum(t.nbytes for t in _unique(training.state())) / MiB
    overhead = statistics.median(with_ck) / statistics.median(base) - 1
    print(
        f"overlap: {state_mib:.0f} MiB state, {iter_s * 1e3:.1f} ms per iteration, a save alone {save_s * 1e3:.0f} ms; "
        f"one warmed Checkpointer(every={every}), {2 * every} iterations: {overhead * 100:.1f}% per-iteration "
        f"overhead (median of {reps})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=parse_size("512MiB"), help="state size, e.g. 512MiB, 1GiB")
    parser.add_argument("--dir", default="/tmp", help="the checkpoints go to DIR/bench (removed at the end)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: smoke mode, no figures")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per timed figure (the median is shown)")
    parser.add_argument(
        "--staging-sizes",
        default="1GiB,4GiB,12GiB",
        help="synthetic states whose staging is timed (benches/gpu_targets.py)",
    )
    parser.add_argument("--targets-s", type=float, default=90.0, help="seconds for benches/gpu_targets.py's sections")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("torch sees no CUDA device (use --device cpu for the smoke mode)")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    root = os.path.join(args.dir, "bench")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke mode: figures mean nothing)"
    backend, reason = _core.select_backend("auto")
    print(
        f"device: {name}; torch {torch.__version__} (CUDA {torch.version.cuda}); fastpersist {fp.__version__}; "
        f"backend {backend}{f' ({reason})' if reason else ''}; direct I/O on {root}: "
        f"{_core.direct_io_supported(root)}",
        flush=True,
    )
    ts = TrainingState(args.size, device)
    ok = check_round_trip(ts, root)  # the checks that decide the exit status come first
    ok = check_load(ts, root, args.reps) and ok
    check_staging(ts, root, args.reps)
    check_save(ts, root, args.reps)
    del ts
    sizes = [parse_size(s) for s in args.staging_sizes.split(",")] if device.type == "cuda" else [16 * MiB]
    gpu_targets.run(device, root, args.reps, sizes, args.targets_s)
    check_overlap(args.size, device, root, args.reps)
    shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
