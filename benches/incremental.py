"""Incremental saves (``fp.Incremental``) against a full ``fp.save`` and ``torch.save``, side by side.

Cases (each a training-like loop on the CPU, the state saved after every step):

* ``lora``: a frozen bf16 base of ``--gib`` GiB plus trainable adapters of 1% of its parameters
  in fp32, with their AdamW state (exp_avg, exp_avg_sq): every step changes every adapter byte.
* ``lora-interleaved``: the same, each layer's adapters beside its frozen weight (as a LoRA
  model's state_dict has them).
* ``half-frozen``: fp32 layers, the first half frozen, the second trained with AdamW.
* ``embedding``: an fp32 table whose steps touch 5% of its rows, Zipf-distributed.

Each case's step says how many bytes it changed (the touched rows' own bytes for the table): the
least any save could write, printed beside what the incremental save wrote.
* ``everything``: the same bytes, all changed every step (full training): the content check's
  cost against a plain ``fp.save`` (target: at most 5% slower).

For each it prints, medians over ``--steps`` saves after the first: the bytes each save wrote,
its seconds, and the same state saved in full by ``fp.save`` and by ``torch.save`` (+ fsync),
alternated step by step so that they share the disk's moods; then the load of the last
incremental step against the load of a full one. Every figure is measured in this run.

Run: ``python benches/incremental.py --gib 1 --steps 10`` (``--case lora`` for one case).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import fastpersist as fp


def adamw_steps(params: list[torch.nn.Parameter]) -> tuple[torch.optim.Optimizer, Callable[[], int]]:
    """An AdamW over `params`, stepped once (its moments exist), and a step with random gradients
    that returns the bytes it changed: the parameters and their two moments."""
    opt = torch.optim.AdamW(params, lr=1e-3)

    def step() -> int:
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        return sum(p.nbytes for p in params) * 3

    step()
    return opt, step


def lora_state(gib: float) -> tuple[dict[str, Any], Callable[[], int]]:
    """A frozen bf16 base (gib GiB), 1% of its parameter count as fp32 adapters with AdamW state, and
    a step that changes every adapter value and moment."""
    width = 4096
    rows = max(1, int(gib * (1 << 30)) // 2 // width // 64) * 64
    base = {f"layer{i}.weight": torch.randn(64, width).to(torch.bfloat16) for i in range(rows // 64)}
    adapter_params = max(width, rows * width // 100)
    adapters = torch.nn.Parameter(torch.randn(adapter_params // width, width) * 0.01)
    opt, step = adamw_steps([adapters])
    state = {"model": {**base, "adapters": adapters}, "optimizer": opt.state_dict()}
    return state, step


def lora_interleaved_state(gib: float) -> tuple[dict[str, Any], Callable[[], int]]:
    """``lora`` as a LoRA model's state_dict lays it out: each layer's frozen weight followed by its
    own small adapters (rank 8), so the changing bytes are scattered through the stream."""
    width, rank = 4096, 8
    layers = max(1, int(gib * (1 << 30)) // 2 // (width * width))
    base = [torch.randn(width, width).to(torch.bfloat16) for _ in range(layers)]
    lora = [torch.nn.Parameter(torch.randn(rank, width) * 0.01) for _ in range(2 * layers)]
    opt, step = adamw_steps(lora)
    model: dict[str, Any] = {}
    for i, weight in enumerate(base):
        model[f"layer{i}.weight"] = weight
        model[f"layer{i}.lora_A"], model[f"layer{i}.lora_B"] = lora[2 * i], lora[2 * i + 1]
    return {"model": model, "optimizer": opt.state_dict()}, step


def half_frozen_state(gib: float) -> tuple[dict[str, Any], Callable[[], int]]:
    """fp32 layers of gib GiB in all with AdamW state for the trainable half: the first half of the
    layers frozen (weights only), the second half trained (weights and both moments change)."""
    width, layers = 4096, 16
    rows = max(1, int(gib * (1 << 30)) // 4 // width // (layers // 2 + layers // 2 * 3))
    frozen = [torch.randn(rows, width) for _ in range(layers // 2)]
    trained = [torch.nn.Parameter(torch.randn(rows, width)) for _ in range(layers // 2)]
    opt, step = adamw_steps(trained)
    model = {f"layer{i}": t for i, t in enumerate([*frozen, *trained])}
    return {"model": model, "optimizer": opt.state_dict()}, step


def embedding_state(gib: float) -> tuple[dict[str, Any], Callable[[], int]]:
    """An fp32 embedding table of gib GiB whose every step adds to 5% of its rows, drawn from a
    Zipf distribution (a few hot rows, a long tail), the ranks spread over the table by a fixed
    permutation, as hashed ids are."""
    width = 128
    rows = max(1, int(gib * (1 << 30)) // 4 // width)
    table = torch.randn(rows, width)
    gen = torch.Generator().manual_seed(0)
    spread = torch.randperm(rows, generator=gen)
    touched = max(1, rows // 20)
    ranks = torch.distributions.Categorical(probs=1.0 / torch.arange(1, rows + 1, dtype=torch.float64))

    def step() -> int:
        ids = spread[ranks.sample((touched,)).clamp_(max=rows - 1)].unique()
        table[ids] += 0.01
        return len(ids) * width * 4

    return {"embedding": table}, step


def everything_state(gib: float) -> tuple[dict[str, Any], Callable[[], int]]:
    """fp32 tensors of gib GiB in all, every byte changed by each step."""
    n = int(gib * (1 << 30)) // 4 // 16
    tensors = [torch.randn(n) for _ in range(16)]

    def step() -> int:
        for t in tensors:
            t.add_(1.0)
        return sum(t.nbytes for t in tensors)

    return {f"t{i}": t for i, t in enumerate(tensors)}, step


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def torch_save(state: Any, path: str) -> int:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return os.path.getsize(path)


def run_case(name: str, make: Callable[..., Any], gib: float, steps: int, work: str, block: int) -> None:
    state, step = make(gib)
    inc = fp.Incremental(block_bytes=block)
    rows: dict[str, list[float]] = {k: [] for k in ("inc_s", "inc_bytes", "full_s", "full_bytes", "torch_s", "changed")}
    previous = os.path.join(work, f"{name}-inc-0")
    fp.save(state, previous, incremental=inc)  # the first, full step
    fp.save(state, os.path.join(work, f"{name}-full"))  # warm-up of the plain path
    for i in range(1, steps + 1):
        rows["changed"].append(step())
        path = os.path.join(work, f"{name}-inc-{i}")
        increment = fp.Incremental(base=previous, block_bytes=block)
        seconds, result = timed(lambda path=path, increment=increment: fp.save(state, path, incremental=increment))
        rows["inc_s"].append(seconds)
        rows["inc_bytes"].append(result.nbytes)
        shutil.rmtree(previous)  # retention keep=1: the new step stands alone
        previous = path
        seconds, result = timed(lambda: fp.save(state, os.path.join(work, f"{name}-full")))
        rows["full_s"].append(seconds)
        rows["full_bytes"].append(result.nbytes)
        fp.wait_removed()
        if i <= 3:  # torch.save is slow: three rounds
            seconds, _ = timed(lambda: torch_save(state, os.path.join(work, f"{name}.pt")))
            rows["torch_s"].append(seconds)
    med = {k: statistics.median(v) for k, v in rows.items() if v}
    mib = 1 << 20
    print(
        f"{name}: per step, median of {steps} (torch.save of 3): changed {med['changed'] / mib:.1f} MiB, written / "
        f"changed {med['inc_bytes'] / med['changed']:.2f}x; incremental {med['inc_bytes'] / mib:.1f} MiB in "
        f"{med['inc_s']:.3f} s; full fp.save {med['full_bytes'] / mib:.1f} MiB in {med['full_s']:.3f} s; torch.save "
        f"{med['torch_s']:.3f} s. Bytes full / incremental {med['full_bytes'] / max(1, med['inc_bytes']):.1f}x; "
        f"time full / incremental {med['full_s'] / med['inc_s']:.2f}x, torch.save / incremental "
        f"{med['torch_s'] / med['inc_s']:.2f}x"
    )
    loads: dict[str, list[float]] = {"inc": [], "full": []}  # O_DIRECT reads: the page cache plays no part
    for _ in range(3):
        for kind, path in (("inc", previous), ("full", os.path.join(work, f"{name}-full"))):
            seconds, _ = timed(lambda path=path: fp.load(path))
            loads[kind].append(seconds)
    print(
        f"{name}: load of the last incremental step {statistics.median(loads['inc']):.3f} s, of a full step "
        f"{statistics.median(loads['full']):.3f} s (median of 3)"
    )


CASES: dict[str, Callable[[float], tuple[dict[str, Any], Callable[[], int]]]] = {
    "lora": lora_state,
    "lora-interleaved": lora_interleaved_state,
    "half-frozen": half_frozen_state,
    "embedding": embedding_state,
    "everything": everything_state,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--block-bytes", type=int, default=fp.Incremental().block_bytes)
    parser.add_argument("--case", choices=sorted(CASES), nargs="+", default=list(CASES))
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="fp-bench-incremental-") as work:
        for name in args.case:
            run_case(name, CASES[name], args.gib, args.steps, work, args.block_bytes)


if __name__ == "__main__":
    main()
