"""The GPU staging targets (docs/gpu.md), measured side by side with a plain pinned copy of the
same tensors. benches/gpu_check.py runs these sections after its own; each prints its lines as
soon as they are measured, and each is skipped (saying so) when the bench's time is nearly out.

* staging of synthetic fp32 states (1, 4, 12 GiB by default): ``save_async`` until
  ``wait_staged()`` with the default Config, the save then cancelled (only the staging is
  measured), against a copy of the same tensors into one reused registered buffer (target 1.3x);
* a real training loop (GPT-2 from ``transformers``, built from a config: 8 layers, width 768,
  bf16 autocast, fused AdamW): training time lost per checkpoint with the README recipe
  (``save_async`` after ``optimizer.step()``, ``wait_staged()`` before the next one) against the
  same loop with a plain pinned copy in its place (target 1.2x); and the per-step overhead of a
  checkpoint every step, ``Checkpointer(every=1)`` and the plain copy (target 3%);
  and the same on the memory level (a root under /dev/shm: each step staged into its recycled
  data file), with how many of the timed steps committed there; and every step in a gloo group
  of this one process (a step due while the disk is busy is skipped), with how many were saved;
* pinned memory over 100 saves: what the process holds after the first save and after the 100th.

``--device cpu`` (the smoke mode) runs every section with tiny sizes; its figures mean nothing.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import fastpersist as fp
from fastpersist import _core
from fastpersist.gpu.arenas import ARENAS
from fastpersist.gpu.copiers import device_bytes
from fastpersist.gpu.pinned import pin_host

MiB = 1 << 20
GiB = 1 << 30


class Budget:
    """The bench's remaining time: a section that needs more than is left is skipped."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def allows(self, section: str, needs_s: float) -> bool:
        left = self.deadline - time.monotonic()
        if left < needs_s:
            print(f"{section}: not run ({left:.0f} s left of the bench's time, it needs about {needs_s:.0f} s)")
            return False
        return True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PlainCopy:
    """The baseline: every tensor copied into one reused registered host buffer (one non-blocking
    ``copy_`` each, on a side stream that waits for the caller's), then one event."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        self.arena = _core.Arena(max(nbytes, 1))
        self.host = torch.frombuffer(self.arena, dtype=torch.uint8)
        if device.type == "cuda":
            pin_host(self.host, self.arena)
        self.stream: Any = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.done: Any = None

    def start(self, tensors: list[torch.Tensor]) -> None:
        """Queues the copies (returns at once on a GPU)."""
        offset = 0
        if self.stream is None:
            for t in tensors:
                src = device_bytes(t)
                self.host[offset : offset + src.numel()].copy_(src)
                offset += src.numel()
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for t in tensors:
                src = device_bytes(t)
                self.host[offset : offset + src.numel()].copy_(src, non_blocking=True)
                offset += src.numel()
            self.done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self.done.record(self.stream)

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()
            self.done = None


def tensors_of(node: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a nested state (dicts, lists, tuples), in order, repeats included."""
    if isinstance(node, torch.Tensor):
        yield node
    elif isinstance(node, dict):
        for v in node.values():
            yield from tensors_of(v)
    elif isinstance(node, (list, tuple)):
        for v in node:
            yield from tensors_of(v)


def check_staging_sizes(sizes: list[int], device: torch.device, root: str, reps: int, budget: Budget) -> None:
    for nbytes in sizes:
        if not budget.allows(f"staging of {nbytes / GiB:.0f} GiB", 6 + nbytes / GiB * 3):
            return
        per = min(256 * MiB, nbytes) // 4
        state = {f"w{i}": torch.randn(per, device=device) for i in range(max(1, nbytes // (per * 4)))}
        tensors = list(state.values())
        total = sum(t.nbytes for t in tensors)
        plain = PlainCopy(total, device)

        def plain_copy(plain: PlainCopy = plain, tensors: list[torch.Tensor] = tensors) -> None:
            plain.start(tensors)
            plain.wait()

        plain_copy()  # first touch
        plain_s = []
        for _ in range(reps):
            _sync(device)
            start = time.perf_counter()
            plain_copy()
            plain_s.append(time.perf_counter() - start)
        staged_s = []
        for rep in range(reps + 1):  # the first makes (and registers) the arena
            _sync(device)
            start = time.perf_counter()
            fut = fp.save_async(state, os.path.join(root, f"sizes-{rep}"))
            fut.wait_staged()
            seconds = time.perf_counter() - start
            fut.cancel()  # only the staging is measured: the write stops here
            try:
                fut.wait()
            except fp.SaveCancelledError:
                pass
            if rep:
                staged_s.append(seconds)
        plain_med, staged_med = statistics.median(plain_s), statistics.median(staged_s)
        print(
            f"staging {total / GiB:.1f} GiB in {len(tensors)} fp32 tensors: save_async -> wait_staged "
            f"{staged_med * 1e3:.0f} ms, plain pinned copy {plain_med * 1e3:.0f} ms "
            f"({total / 1e9 / plain_med:.1f} GB/s) "
            f"= {staged_med / plain_med:.2f}x (target <= 1.3x); arenas {fp.gpu.arena_bytes() / GiB:.1f} GiB",
            flush=True,
        )
        del state, tensors, plain
        if device.type == "cuda":
            torch.cuda.empty_cache()


class _Loop:
    """GPT-2 (8 layers, width 768) trained on random tokens: bf16 autocast, fused AdamW."""

    def __init__(self, device: torch.device) -> None:
        from transformers import GPT2Config, GPT2LMHeadModel

        cuda = device.type == "cuda"
        if cuda:
            config = GPT2Config(n_layer=8, n_embd=768, n_head=12)
        else:  # the smoke mode: a tiny one
            config = GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=1000, n_positions=64)
        self.device = device
        self.model = GPT2LMHeadModel(config).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=cuda)
        self.tokens = torch.randint(0, config.vocab_size, (8 if cuda else 1, 512 if cuda else 16), device=device)

    def state(self, step: int) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": step}

    def run(self, steps: int, before_step: Callable[[int], None], after_step: Callable[[int], None]) -> float:
        """Seconds for `steps` iterations; the hooks run before and after each optimizer step."""
        _sync(self.device)
        start = time.perf_counter()
        for k in range(steps):
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                loss = self.model(self.tokens, labels=self.tokens).loss
            loss.backward()
            before_step(k)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            after_step(k)
        _sync(self.device)
        return time.perf_counter() - start


def check_training_loop(device: torch.device, root: str, reps: int, budget: Budget) -> None:
    if not budget.allows("training loop", 40):
        return
    try:
        loop = _Loop(device)
    except ImportError:
        print("training loop: not measured (transformers is not installed)")
        return
    nothing: Callable[[int], None] = lambda k: None  # noqa: E731
    loop.run(5, nothing, nothing)  # warm-up: the AdamW moments, autotuning, the allocator
    window = 25
    tensors = list(tensors_of(loop.state(0)))
    nbytes = sum(t.nbytes for t in tensors)
    plain = PlainCopy(nbytes, device)
    futures: list[Any] = []

    def recipe_save(k: int) -> None:
        if k == 0:
            futures.append(fp.save_async(loop.state(k), os.path.join(root, "loop")))

    def recipe_wait(k: int) -> None:
        if k == 1:
            futures[-1].wait_staged()

    def plain_start(k: int) -> None:
        if k == 0:
            plain.start(list(tensors_of(loop.state(k))))

    def plain_wait(k: int) -> None:
        if k == 1:
            plain.wait()

    recipe_save(0)
    futures[-1].wait()  # the arena is made (and registered) outside the timed windows
    base, ours, theirs = [], [], []
    for _ in range(reps):
        base.append(loop.run(window, nothing, nothing))
        futures.clear()
        ours.append(loop.run(window, recipe_wait, recipe_save))
        futures[-1].wait()
        theirs.append(loop.run(window, plain_wait, plain_start))
    step_s = statistics.median(base) / window
    lost_ours = statistics.median(ours) - statistics.median(base)
    lost_plain = statistics.median(theirs) - statistics.median(base)
    print(
        f"training loop (GPT-2, {nbytes / MiB:.0f} MiB state in {len(tensors)} tensors, {step_s * 1e3:.1f} ms steps): "
        f"time lost per checkpoint, README recipe {lost_ours * 1e3:.1f} ms, "
        f"plain pinned copy {lost_plain * 1e3:.1f} ms "
        f"= {lost_ours / max(lost_plain, 1e-4):.2f}x (target <= 1.2x)",
        flush=True,
    )
    every_step_plain = loop.run(window, lambda k: plain.wait(), lambda k: plain.start(list(tensors_of(loop.state(k)))))
    plain.wait()
    ck = fp.Checkpointer(os.path.join(root, "every1"), every=1, keep=2)
    every_step_ck = loop.run(window, lambda k: ck.wait_staged(), lambda k: ck.save(k, loop.state(k)))
    ck.close()
    base_s = statistics.median(base)
    print(
        f"  a copy every step: plain pinned copy +{(every_step_plain / base_s - 1) * 100:.1f}% per step; "
        f"Checkpointer(every=1) +{(every_step_ck / base_s - 1) * 100:.1f}% per step (target <= 3%)",
        flush=True,
    )
    check_group_every_step(loop, window, base_s, root)
    check_memory_level(loop, window, base_s)


def check_group_every_step(loop: _Loop, window: int, base_s: float, root: str) -> None:
    """``Checkpointer(every=1, group=...)`` in a gloo group of this one process: a step due while
    the previous save still writes is skipped (decided by the ranks' all-reduce, docs/levels.md),
    so the loop pays the agreement and one copy per saved step."""
    import torch.distributed as dist

    if dist.is_initialized():
        print("  every=1 in a group: not measured (a process group is already initialised)")
        return
    store = tempfile.mktemp(prefix="fp-gpu-group-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        ck = fp.Checkpointer(os.path.join(root, "every1-group"), every=1, keep=2, group=dist.group.WORLD)
        ck.save(0, loop.state(0))
        ck.wait()  # the control groups, the arena
        futures: list[Any] = []
        timed = loop.run(window, lambda k: ck.wait_staged(), lambda k: futures.append(ck.save(1 + k, loop.state(k))))
        ck.close()
        saved = sum(1 for f in futures if f is not None)
        print(
            f"  every=1 in a group (1 gloo rank): +{(timed / base_s - 1) * 100:.1f}% per step; "
            f"{saved} of {window} steps saved, the rest skipped while the disk was busy",
            flush=True,
        )
    finally:
        dist.destroy_process_group()
        if os.path.exists(store):
            os.remove(store)


def check_memory_level(loop: _Loop, window: int, base_s: float) -> None:
    """``Checkpointer(every=1, keep=2)`` on a root under /dev/shm: each step staged into its
    recycled data file (docs/levels.md). A first window makes the files, their arenas and their
    registrations; the second is timed, and says how many of its steps committed there."""
    if not os.path.isdir("/dev/shm"):
        print("  memory level: not measured (no /dev/shm)")
        return
    parent = tempfile.mkdtemp(prefix="fp-gpu-memlevel-", dir="/dev/shm")
    try:
        ck = fp.Checkpointer(os.path.join(parent, "ck"), every=1, keep=2)
        loop.run(window, lambda k: ck.wait_staged(), lambda k: ck.save(k, loop.state(k)))
        ck.wait()
        ARENAS.wait_pinned()  # the files' arenas, registered in the background after the warm-up's saves
        futures: list[Any] = []
        timed = loop.run(
            window, lambda k: ck.wait_staged(), lambda k: futures.append(ck.save(window + k, loop.state(k)))
        )
        ck.close()
        committed = sum(1 for f in futures if f is not None and _committed(f))
        print(
            f"  memory level (/dev/shm, every=1, keep=2): +{(timed / base_s - 1) * 100:.1f}% per step (target <= 3%); "
            f"{committed} of {window} steps committed there; "
            f"arenas {fp.gpu.arena_bytes() / MiB:.0f} MiB, pinned {fp.gpu.pinned_bytes() / MiB:.0f} MiB",
            flush=True,
        )
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def _committed(future: Any) -> bool:
    try:
        future.wait()
    except fp.FastPersistError:  # a snapshot a newer step replaced
        return False
    return True


def check_pinned_growth(device: torch.device, root: str, budget: Budget) -> None:
    if not budget.allows("pinned memory over 100 saves", 20):
        return
    state = {f"w{i}": torch.randn(4 * MiB, device=device) for i in range(4)}  # 64 MiB
    fp.save_async(state, os.path.join(root, "growth")).wait()
    first = (fp.gpu.pinned_bytes(), fp.gpu.arena_bytes())
    for _ in range(99):
        fp.save_async(state, os.path.join(root, "growth")).wait()
    last = (fp.gpu.pinned_bytes(), fp.gpu.arena_bytes())
    print(
        f"pinned memory over 100 saves of 64 MiB: pinned {first[0] / MiB:.0f} -> {last[0] / MiB:.0f} MiB, "
        f"arenas {first[1] / MiB:.0f} -> {last[1] / MiB:.0f} MiB (target: no growth, <= Config.pinned_bytes)",
        flush=True,
    )


def run(device: torch.device, root: str, reps: int, sizes: list[int], budget_s: float) -> None:
    """Every section, in order of importance, within `budget_s` seconds."""
    budget = Budget(budget_s)
    check_staging_sizes(sizes, device, root, reps, budget)
    check_training_loop(device, root, reps, budget)
    check_pinned_growth(device, root, budget)
