"""Code that runs inside each rank of the distributed tests (spawned processes, gloo backend)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import fastpersist as fp

from fake_cuda import LaterCopier
from gloo import report_rank


def make_state(seed: int, tensors: int = 12) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    emb = torch.randn(300, 64, generator=gen)
    return {
        "model": {f"layer{i}.weight": torch.randn(64 + i, 97, generator=gen) for i in range(tensors)}
        | {"emb": emb, "head": emb},
        "opt": {"state": {i: {"exp_avg": torch.randn(500, generator=gen)} for i in range(4)}, "lr": 0.1},
        "step": seed,
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def run(rank: int, world: int, init_file: str, scenario: str, workdir: str, backend: str) -> None:
    """Entry point of each spawned rank; writes result-{rank}.json (or error-{rank}.txt)."""
    report_rank(
        rank,
        world,
        init_file,
        workdir,
        lambda: SCENARIOS[scenario](rank, world, workdir, backend),
        destroy=scenario not in ("killed_rank", "killed_at_agreement"),
    )


def replicated(rank: int, world: int, workdir: str, backend: str) -> dict[str, Any]:
    state = make_state(7)
    stripes = [os.path.join(workdir, f"rank{rank}-ssd{i}") for i in range(2)]  # differ per rank
    for d in stripes:
        os.makedirs(d, exist_ok=True)
    cfg = fp.Config(backend=backend, chunk_bytes=64 << 10, stripes=stripes)
    path = os.path.join(workdir, "ckpt")
    res = fp.save(state, path, config=cfg, group=dist.group.WORLD)
    loaded = fp.load(path, group=dist.group.WORLD)
    # An async save through the same group, then a Checkpointer in the group.
    fut = fp.save_async(make_state(8), os.path.join(workdir, "ckpt-async"), config=cfg, group=dist.group.WORLD)
    fut.wait_staged()
    fut.wait()
    ck = fp.Checkpointer(os.path.join(workdir, "run"), keep=2, group=dist.group.WORLD)
    for step in range(3):
        ck.save(step, make_state(step))
    ck.wait()
    dist.barrier()
    return {
        "nbytes": res.nbytes,
        "files": res.files,
        "same": same(state, loaded),
        "async_same": same(make_state(8), fp.load(os.path.join(workdir, "ckpt-async"))),
        "latest": ck.latest(),
        "ck_same": same(make_state(2), ck.load()),
    }


def writers_node(rank: int, world: int, workdir: str, backend: str) -> dict[str, Any]:
    cfg = fp.Config(backend=backend, chunk_bytes=64 << 10, writers="node")
    res = fp.save(make_state(3), os.path.join(workdir, "node"), config=cfg, group=dist.group.WORLD)
    return {"nbytes": res.nbytes}


def sharded(rank: int, world: int, workdir: str, backend: str) -> dict[str, Any]:
    mine = make_state(100 + rank, tensors=3 + rank)  # shapes differ per rank
    cfg = fp.Config(backend=backend, chunk_bytes=64 << 10)
    path = os.path.join(workdir, "sharded")
    fp.save(mine, path, config=cfg, group=dist.group.WORLD, sharded=True)
    return {"same": same(mine, fp.load(path, group=dist.group.WORLD))}


def _previous_then(
    rank: int, workdir: str, backend: str, timeout_s: float, bad: Callable[[int], Any]
) -> dict[str, Any]:
    cfg = fp.Config(backend=backend, chunk_bytes=64 << 10, timeout_s=timeout_s)
    path = os.path.join(workdir, "ckpt")
    fp.save(make_state(1), path, config=fp.Config(chunk_bytes=64 << 10), group=dist.group.WORLD)
    started = time.monotonic()
    group_error = False
    try:
        fp.save(bad(rank), path, config=cfg, group=dist.group.WORLD)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        group_error = isinstance(e, fp.GroupSaveError) and isinstance(e, fp.FastPersistError)
    else:
        error = ""
    elapsed = time.monotonic() - started
    previous_ok = same(make_state(1), fp.load(path))
    return {"error": error, "group_error": group_error, "elapsed": elapsed, "previous_ok": previous_ok}


def failing_rank(rank: int, world: int, workdir: str, backend: str) -> dict[str, Any]:
    def bad(r: int) -> Any:
        state = make_state(2)
        if r == 1:
            state["oops"] = object()  # rank 1 fails while flattening
        return state

    return _previous_then(rank, workdir, backend, 30.0, bad)


def killed_rank(rank: int, world: int, workdir: str, backend: str) -> dict[str, Any]:
    cfg = fp.Config(backend=backend, chunk_bytes=64 << 10, timeout_s=5.0)
    path = os.path.join(workdir, "ckpt")
    fp.save(make_state(1), path, config=cfg, group=dist.group.WORLD)
    started = time.monotonic()
    fut = fp.save_async(make_state(2), path, config=cfg, group=dist.group.WORLD)
    if rank == 1:
        os._exit(3)  # killed mid-save
    try:
        fut.wait()
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    else:
        error = ""
    return {"error": error, "elapsed": time.monotonic() - started, "previous_ok": same(make_state(1), fp.load(path))}


def killed_at_agreement(rank: int, world: int, workdir: str, backend: str) -> dict[str, Any]:
    """A device-state group Checkpointer: rank 1 dies after step 0; rank 0's next due step fails
    in the ranks' agreement on whether to save it, at once (the lane's watch), not after timeout_s."""
    from fastpersist.gpu.copiers import use_copier

    cfg = fp.Config(backend=backend, chunk_bytes=64 << 10, timeout_s=60.0)
    with use_copier(lambda t: True, LaterCopier):
        ck = fp.Checkpointer(os.path.join(workdir, "run"), keep=2, group=dist.group.WORLD, config=cfg)
        ck.save(0, make_state(0))
        ck.wait()
        dist.barrier()
        if rank == 1:
            os._exit(3)
        started = time.monotonic()
        try:
            ck.save(1, make_state(1))
            error = ""
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    return {"error": error, "elapsed": time.monotonic() - started, "steps": ck.steps()}


def hung_rank(rank: int, world: int, workdir: str, backend: str) -> dict[str, Any]:
    if rank == 1:  # rank 1 stalls inside its share of the save, longer than the timeout
        from fastpersist.saving.job import SaveJob

        original = SaveJob.wait_written

        def stalled(self: SaveJob, timeout: float | None = None) -> Any:
            time.sleep(7)
            return original(self, timeout)

        SaveJob.wait_written = stalled  # type: ignore[method-assign]

    def unchanged(r: int) -> Any:
        return make_state(2)

    return _previous_then(rank, workdir, backend, 3.0, unchanged)


def enospc_rank(rank: int, world: int, workdir: str, backend: str) -> dict[str, Any]:
    small = os.path.join(workdir, "tiny")  # a 1 MiB tmpfs mounted by the test for rank 1
    cfg_for = {0: [os.path.join(workdir, "big")], 1: [small]}
    os.makedirs(cfg_for[0][0], exist_ok=True)
    cfg = fp.Config(backend=backend, chunk_bytes=64 << 10, stripes=cfg_for[rank], timeout_s=30.0)
    path = os.path.join(workdir, "ckpt")
    fp.save({"w": torch.zeros(10)}, path, config=cfg, group=dist.group.WORLD)
    started = time.monotonic()
    try:
        fp.save({"w": torch.randn(4 << 20)}, path, config=cfg, group=dist.group.WORLD)  # 16 MiB: 8 per rank
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    else:
        error = ""
    return {"error": error, "elapsed": time.monotonic() - started, "previous_ok": fp.load(path)["w"].numel() == 10}


def torn_rank(rank: int, world: int, workdir: str, backend: str) -> dict[str, Any]:
    """Rank 1 steps its optimizer before its share was staged; rank 0 behaves."""
    cfg = fp.Config(backend=backend, chunk_bytes=64 << 10, pool_bytes=128 << 10, queue_depth=1)
    path = os.path.join(workdir, "ckpt")
    fp.save(make_state(1), path, config=cfg, group=dist.group.WORLD)
    state = {"w": torch.zeros((32 << 20) // 4), "step": 2}
    fut = fp.save_async(state, path, config=cfg, group=dist.group.WORLD)
    staged_error = ""
    if rank == 1:
        state["w"][-1:].add_(1)
        try:
            fut.wait_staged()
        except Exception as e:
            staged_error = f"{type(e).__name__}: {e}"
    try:
        fut.wait()
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    else:
        error = ""
    return {"staged_error": staged_error, "error": error, "previous_ok": same(make_state(1), fp.load(path))}


def copy_guard(rank: int, world: int, workdir: str, backend: str) -> dict[str, Any]:
    """guard="copy": writes through .data and .numpy() right after save_async returns stay out."""
    cfg = fp.Config(backend=backend, chunk_bytes=64 << 10, pool_bytes=256 << 10, guard="copy")
    state = {f"w{i}": torch.full(((2 << 20) // 4,), float(i)) for i in range(4)}
    expected = {k: v.clone() for k, v in state.items()}
    path = os.path.join(workdir, "copy-guard")
    fut = fp.save_async(state, path, config=cfg, group=dist.group.WORLD)
    for i, t in enumerate(reversed(list(state.values()))):
        if i % 2:
            t.data.add_(100)
        else:
            t.numpy()[:] += 100
    fut.wait()
    dist.barrier()
    return {"same": same(expected, fp.load(path)), "changed": not same(expected, state)}


def dtensor_leaf(rank: int, world: int, workdir: str, backend: str) -> dict[str, Any]:
    """What saving a DTensor (plain, and as an FSDP2-style Parameter) raises: type and message."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (world,))
    dt = DTensor.from_local(torch.ones(4), mesh, [Replicate()])
    raised = {}
    for name, leaf in (("plain", dt), ("param", torch.nn.Parameter(dt))):
        try:
            fp.save({"model": {"w": leaf}}, os.path.join(workdir, f"dtensor-{name}"))
            raised[name] = "nothing"
        except Exception as e:
            raised[name] = f"{type(e).__name__}: {e}"
    return {"raised": raised, "written": sorted(os.listdir(workdir))}


def long_name(rank: int, world: int, workdir: str, backend: str) -> dict[str, Any]:
    """A group save of a name too long for the hidden directories: what each rank raises."""
    stripes = [os.path.join(workdir, "ssd")]
    os.makedirs(stripes[0], exist_ok=True)
    cfg = fp.Config(backend=backend, chunk_bytes=64 << 10, stripes=stripes)
    try:
        fp.save(make_state(1), os.path.join(workdir, "n" * 240), config=cfg, group=dist.group.WORLD)
        raised = "nothing"
    except Exception as e:
        raised = f"{type(e).__name__}: {e}"
    dist.barrier()
    return {"raised": raised, "written": sorted(os.listdir(workdir)), "stripe": os.listdir(stripes[0])}


def device_group(rank: int, world: int, workdir: str, backend: str) -> dict[str, Any]:
    """Replicated and sharded saves of a state whose tensors a (fake) device copier stages:
    each rank's share goes through its arena; a group Checkpointer saves each step it waits for."""
    from fastpersist.gpu.copiers import use_copier

    cfg = fp.Config(backend=backend, chunk_bytes=64 << 10)
    with use_copier(lambda t: True, LaterCopier):
        state = make_state(7)
        fut = fp.save_async(state, os.path.join(workdir, "replicated"), config=cfg, group=dist.group.WORLD)
        fut.wait_staged()
        for t in state["model"].values():
            t.add_(1)  # after wait_staged(): not in the checkpoint
        fut.wait()
        shard = make_state(10 + rank)
        fp.save(shard, os.path.join(workdir, "sharded"), config=cfg, group=dist.group.WORLD, sharded=True)
        ck = fp.Checkpointer(os.path.join(workdir, "run"), keep=2, group=dist.group.WORLD, config=cfg)
        for step in range(3):
            ck.wait_staged()
            ck.save(step, make_state(step))
            ck.wait()  # else a step due while a save still writes is skipped (device_group_skips)
        ck.close()
        # The in-memory level: from its second save of a file on, each rank stages its share
        # straight into its recycled data file (gpu/arenas.py, Arenas.lease_file).
        mem = "/dev/shm/fp-device-group" + workdir.replace(os.sep, "_")
        mem_ck = fp.Checkpointer(mem, keep=1, group=dist.group.WORLD, config=cfg)
        for step in range(4):
            mem_ck.save(step, make_state(20 + step))
            mem_ck.wait()
        mem_ck.close()
    from fastpersist.gpu.arenas import ARENAS

    in_place = any(k.over_file for k in ARENAS._kept)
    dist.barrier()
    results = {
        "same": same(make_state(7), fp.load(os.path.join(workdir, "replicated"))),
        "shard_same": same(shard, fp.load(os.path.join(workdir, "sharded"), group=dist.group.WORLD)),
        "steps": ck.steps(),
        "ck_same": same(make_state(2), ck.load()),
        "mem": [mem_ck.steps(), same(make_state(23), mem_ck.load()), in_place],
    }
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(mem, ignore_errors=True)
    return results


def device_group_skips(rank: int, world: int, workdir: str, backend: str) -> dict[str, Any]:
    """Checkpointer(every=1) in a group while rank 1's save of step 0 has not ended (its
    after-commit work is held): a device state skips steps 1 and 2 on every rank, rank 0 too,
    whose own save has ended; a host state waits and saves every step."""
    from fastpersist.checkpointer import Checkpointer
    from fastpersist.gpu.copiers import use_copier

    release = threading.Event()
    after_commit = Checkpointer._after_commit

    def held(self: Checkpointer, step: int, result: Any) -> None:
        after_commit(self, step, result)
        if rank == 1 and step == 0:
            assert release.wait(60)

    Checkpointer._after_commit = held  # type: ignore[method-assign]
    cfg = fp.Config(backend=backend, chunk_bytes=64 << 10)
    out: dict[str, Any] = {}
    for kind in ("device", "host"):
        release.clear()
        ck = fp.Checkpointer(os.path.join(workdir, kind), keep=3, group=dist.group.WORLD, config=cfg)
        on_device = kind == "device"
        with use_copier(lambda t, on_device=on_device: on_device, LaterCopier):
            futures = [ck.save(0, make_state(0))]
            while rank == 0 and ck.in_flight.disk_busy():
                time.sleep(0.01)  # rank 0's own save of step 0 ends; rank 1's is held
            dist.barrier()
            if kind == "host" and rank == 1:
                threading.Timer(0.5, release.set).start()  # the host state's step 1 waits for it
            futures += [ck.save(step, make_state(step)) for step in (1, 2)]
            release.set()
            ck.wait()
            futures.append(ck.save(3, make_state(3)))
            ck.close()
        out[kind] = {
            "returned": [f is not None for f in futures],
            "steps": ck.steps(),
            "levels": ck.levels(),
            "same": same(make_state(3), ck.load()),
        }
    Checkpointer._after_commit = after_commit  # type: ignore[method-assign]
    return out


class FailedSave:
    """A save whose commit failed (a full disk), as its SaveFuture shows it: wait raises, and
    cancel is too late (its verdict is final)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def wait(self, timeout: float | None = None) -> Any:
        raise OSError(28, "No space left on device", self.path)

    def cancel(self) -> bool:
        return False

    def done(self) -> bool:
        return True


def commit_with_a_failing_rank(rank: int, world: int, workdir: str, backend: str) -> dict[str, Any]:
    """A Commit over the group where `backend` says which part fails on the last rank
    ("save": its save; "publish": rank 0's publish); returns what ran here and what was raised."""
    from fastpersist.distributed.control import control_for
    from fastpersist.saving.commit import Commit

    ran: list[str] = []
    path = os.path.join(workdir, f"r{rank}")
    state = {"w": torch.arange(1024, dtype=torch.float32)}
    futures: list[Any] = [fp.save_async(state, path)]
    if backend == "save" and rank == world - 1:
        futures.append(FailedSave(path + "-full"))

    def publish() -> None:
        ran.append("publish")
        if backend == "publish":
            raise OSError(28, "No space left on device", path)

    commit = Commit(
        f"step-1 of rank {rank}",
        futures,
        control_for(None, 30.0),
        publishes=rank == 0,
        durable=lambda results: ran.append(f"durable {len(results)}"),
        publish=publish,
        retire=lambda: ran.append("retire"),
        abandon=lambda: ran.append("abandon"),
    )
    try:
        commit.run()
        raised = ""
    except Exception as e:
        raised = f"{type(e).__name__}: {e}"
    return {"ran": ran, "raised": raised, "done": all(f.done() for f in futures)}


SCENARIOS: dict[str, Callable[[int, int, str, str], dict[str, Any]]] = {
    "commit_with_a_failing_rank": commit_with_a_failing_rank,
    "device_group_skips": device_group_skips,
    "killed_at_agreement": killed_at_agreement,
    "device_group": device_group,
    "long_name": long_name,
    "dtensor_leaf": dtensor_leaf,
    "copy_guard": copy_guard,
    "torn_rank": torn_rank,
    "replicated": replicated,
    "writers_node": writers_node,
    "sharded": sharded,
    "failing_rank": failing_rank,
    "killed_rank": killed_rank,
    "enospc_rank": enospc_rank,
    "hung_rank": hung_rank,
}
