"""One-shot GPU check (run by scripts/gpu_check.sh on a machine with one NVIDIA GPU).

Prints, in well under five minutes:
1. round-trip correctness of a GPU training state (bf16 params, fp32 Adam moments, BatchNorm
   buffers), saved while the next forward runs;
2. device-to-host GB/s: fastpersist's staging (snapshot pool, until wait_staged) vs
   ``tensor.to("cpu")`` vs a plain ``copy_`` into pinned memory;
3. save GB/s of a GPU state vs torch.save + fsync vs fastpersist saving the same bytes from host
   memory; ``save_async`` return time; GPU memory growth during a save;
4. load GB/s of the same GPU state to ``map_location="cuda"``: fastpersist (pinned windows,
   side-stream copies) vs ``torch.load(map_location="cuda")`` of a torch.save file vs
   fastpersist's host load + ``.to("cuda")``; GPU memory growth beyond the state during a
   load, and host memory (peak RSS growth) of a fastpersist device load;
5. per-iteration overhead of the overlap recipe (Checkpointer every=1) with real GPU compute.

Run: ``python benches/gpu_check.py --size 1GiB --dir /tmp/fp-gpu``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from collections.abc import Callable

import torch

import fastpersist as fp
from fastpersist.integrations import guard_optimizer


def _median_s(fn: Callable[[], object], reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _gpu_state(nbytes: int) -> dict[str, object]:
    n = nbytes // 2 // 4  # half fp32 moments, half bf16 params (+ their fp32 masters)
    return {
        "params": torch.randn(n, device="cuda").to(torch.bfloat16),
        "exp_avg": torch.randn(n // 2, device="cuda"),
        "exp_avg_sq": torch.rand(n // 2, device="cuda"),
        "bn": torch.nn.BatchNorm1d(256).cuda().state_dict(),
    }


def check_round_trip(root: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 8)).cuda()
    model = model.to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    model(x).float().sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    fut = fp.save_async(state, os.path.join(root, "rt"))
    model(x)  # the next forward updates BatchNorm buffers in place while the save runs
    fut.wait_staged()
    fut.wait()
    loaded = fp.load(os.path.join(root, "rt"))
    bad = [k for k, v in expected.items() if not torch.equal(loaded["model"][k], v)]
    print(f"round trip of a GPU training state: {'ok' if not bad else 'MISMATCH ' + str(bad)}")


def check_copies(root: str, nbytes: int) -> None:
    state = _gpu_state(nbytes)
    tensors = [t for t in state.values() if isinstance(t, torch.Tensor)]
    size = sum(t.nbytes for t in tensors)
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    cfg = fp.Config(pool_bytes=-(-size // (8 << 20)) * (8 << 20) + (64 << 20))

    def staged() -> None:
        fut = fp.save_async(state, os.path.join(root, "d2h"), config=cfg)
        fut.wait_staged()
        fut.wait()

    t_to = _median_s(lambda: [t.to("cpu") for t in tensors])
    t_pin = _median_s(lambda: [p.copy_(t) for p, t in zip(pinned, tensors, strict=True)])
    staged()  # warm the pool (and its CUDA registration)
    stage_times = []
    for _ in range(3):
        start = time.perf_counter()
        fut = fp.save_async(state, os.path.join(root, "d2h"), config=cfg)
        returned = time.perf_counter() - start
        fut.wait_staged()
        stage_times.append(time.perf_counter() - start)
        fut.wait()
    t_stage = statistics.median(stage_times)
    gb = size / 1e9
    print(
        f"device-to-host {size / 2**30:.2f} GiB: fastpersist staging {gb / t_stage:.1f} GB/s, "
        f"tensor.to('cpu') {gb / t_to:.1f} GB/s, pinned copy_ {gb / t_pin:.1f} GB/s; "
        f"staging / pinned = {t_pin / t_stage:.2f}x (target >= 0.8)"
    )
    print(f"save_async returned in {returned * 1e3:.1f} ms (target < 10 ms)")

    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t_gpu = _median_s(lambda: fp.save(state, os.path.join(root, "gpu")))
    growth = torch.cuda.max_memory_allocated() - before
    host = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    t_host = _median_s(lambda: fp.save(host, os.path.join(root, "host")))

    def torch_save() -> None:
        with open(os.path.join(root, "t.pt"), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    t_torch = _median_s(torch_save)
    print(
        f"save {size / 2**30:.2f} GiB: from GPU {gb / t_gpu:.2f} GB/s, same bytes from host {gb / t_host:.2f} GB/s "
        f"(GPU / host = {t_host / t_gpu:.2f}x, target >= 0.9), torch.save+fsync {gb / t_torch:.2f} GB/s; "
        f"GPU memory growth during a save: {growth / 2**20:.1f} MiB"
    )


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


def check_load(root: str, nbytes: int) -> None:
    state = _gpu_state(nbytes)
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    size = sum(t.nbytes for t in tensors.values())
    path, pt = os.path.join(root, "load"), os.path.join(root, "load.pt")
    fp.save(state, path)
    with open(pt, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())

    loaded = fp.load(path, map_location="cuda")
    bad = [k for k, v in tensors.items() if not (loaded[k].is_cuda and torch.equal(loaded[k], v))]
    print(f"load to map_location='cuda': {'ok' if not bad else 'MISMATCH ' + str(bad)}")
    del loaded

    def torch_load() -> object:
        _drop_cache(pt)
        return torch.load(pt, map_location="cuda", weights_only=True)

    def host_then_to() -> object:
        host = fp.load(path, map_location="cpu")
        return {k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in host.items()}

    t_fp = _median_s(lambda: fp.load(path, map_location="cuda"))
    t_torch = _median_s(torch_load)
    t_host = _median_s(host_then_to)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    host_growth = _host_peak_growth(lambda: fp.load(path, map_location="cuda"))
    torch.cuda.synchronize()
    growth = torch.cuda.max_memory_allocated() - before - size
    gb = size / 1e9
    host = "n/a" if host_growth is None else f"{host_growth / 2**20:.0f} MiB"
    print(
        f"load {size / 2**30:.2f} GiB to cuda: fastpersist {gb / t_fp:.2f} GB/s, torch.load(map_location='cuda') "
        f"{gb / t_torch:.2f} GB/s, fastpersist host load + .to('cuda') {gb / t_host:.2f} GB/s; "
        f"GPU memory beyond the state during a load: {growth / 2**20:.1f} MiB (target ~0); "
        f"host peak RSS growth: {host} (target ~ two 64 MiB windows)"
    )


def check_overlap(root: str, iters: int = 12) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(24)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(512, 2048, device="cuda")

    def loop(ck: fp.Checkpointer | None) -> float:
        handle = guard_optimizer(opt, ck) if ck is not None else None
        torch.cuda.synchronize()
        start = time.perf_counter()
        for step in range(iters):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if ck is not None:
                ck.save(step, {"model": model.state_dict(), "opt": opt.state_dict()})
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if ck is not None:
            ck.wait()
        if handle is not None:
            handle.remove()
        return elapsed

    loop(None)
    base = statistics.median(loop(None) for _ in range(3))
    with_ck = statistics.median(loop(fp.Checkpointer(os.path.join(root, f"ck{i}"), every=1, keep=1)) for i in range(3))
    print(f"overlap recipe, {iters} iterations: {(with_ck / base - 1) * 100:.1f}% per-iteration overhead")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="1GiB", help="state size, e.g. 512MiB, 1GiB")
    parser.add_argument("--dir", default="/tmp/fp-gpu-check")
    args = parser.parse_args()
    units = {"GiB": 1 << 30, "MiB": 1 << 20}
    nbytes = next(int(float(args.size[: -len(u)]) * m) for u, m in units.items() if args.size.endswith(u))
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: nothing to check")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, fastpersist {fp.__version__}")
    check_round_trip(args.dir)
    check_copies(args.dir, nbytes)
    check_load(args.dir, nbytes)
    check_overlap(args.dir)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
