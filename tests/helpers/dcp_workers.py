"""Code each spawned rank of the DCP plug-in tests runs (gloo, a CPU device mesh)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from gloo import report_rank


def full_weight() -> torch.Tensor:
    return torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) / 7


def full_state() -> dict[str, Any]:
    """The state as one process sees it (what a 1-rank load gets back)."""
    return {
        "w": full_weight(),
        "b": torch.linspace(0, 1, 5).to(torch.bfloat16),
        "step": 5,
        "nested": {"x": torch.tensor([1, 2, 3], dtype=torch.int16), "name": "run"},
    }


def _sharded(placement: Any) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = full_state()
    state["w"] = distribute_tensor(full_weight(), mesh, [placement])
    return state


def save_then_reshard(rank: int, workdir: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard

    from fastpersist.gpu.arenas import ARENAS
    from fastpersist.integrations.dcp import FastPersistReader, FastPersistWriter

    path, async_path = os.path.join(workdir, "dcp"), os.path.join(workdir, "dcp-async")
    dcp.save(_sharded(Shard(0)), storage_writer=FastPersistWriter(path))
    writer = FastPersistWriter(async_path)
    source = _sharded(Shard(0))
    staged = writer.stage(source)  # what dcp.async_save calls: the DTensor's shard in an arena
    snapshot = writer._staged[0]
    results: dict[str, Any] = {
        "staged_dtensor": isinstance(staged["w"], DTensor)
        and staged["w"].placements == source["w"].placements
        and snapshot.holds(staged["w"].to_local())
        and bool(torch.equal(staged["w"].to_local(), source["w"].to_local()))
    }
    snapshot.release()
    writer._staged.clear()
    dcp.async_save(source, storage_writer=writer).result()
    results["arenas_free"] = not any(kept.arena.leased for kept in ARENAS._kept)
    dist.barrier()
    for name, where in (("sync", path), ("async", async_path)):
        target = _sharded(Shard(1))  # another layout: DCP's planner reshards
        target["w"].to_local().zero_()
        target["b"].zero_()
        target["step"] = 0
        dcp.load(target, storage_reader=FastPersistReader(where))
        results[name] = {
            "w": bool(torch.equal(target["w"].full_tensor(), full_weight())),
            "local_cols": list(target["w"].to_local().shape),
            "b": bool(torch.equal(target["b"], full_state()["b"])),
            "step": target["step"],
            "nested": bool(torch.equal(target["nested"]["x"], full_state()["nested"]["x"])),
        }
    return results


def run(rank: int, world: int, init_file: str, workdir: str) -> None:
    report_rank(rank, world, init_file, workdir, lambda: save_then_reshard(rank, workdir))


#: A tensor whose rows (16 KiB) are larger than the chunks (4 KiB) the resharding test writes,
#: so that a column block is a set of separate chunks, not the whole file.
WIDE_SHAPE = (64, 4096)
WIDE_CHUNK_BYTES = 4096


def wide_weight() -> torch.Tensor:
    return torch.arange(WIDE_SHAPE[0] * WIDE_SHAPE[1], dtype=torch.float32).reshape(WIDE_SHAPE) * 0.25 - 7


def _wide_state(placement: Any) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {"w": distribute_tensor(wide_weight(), mesh, [placement]), "step": 9}


def save_wide(rank: int, world: int, init_file: str, workdir: str, path: str) -> None:
    """Saves the wide tensor sharded by rows over the `world` ranks, in 4 KiB chunks."""
    from torch.distributed.tensor import Shard

    import fastpersist as fp
    from fastpersist.integrations.dcp import FastPersistWriter

    def save() -> dict[str, Any]:
        writer = FastPersistWriter(path, fp.Config(chunk_bytes=WIDE_CHUNK_BYTES))
        dcp.save(_wide_state(Shard(0)), storage_writer=writer)
        return {}

    report_rank(rank, world, init_file, workdir, save)


def load_wide_counting(rank: int, world: int, init_file: str, workdir: str, path: str) -> None:
    """Loads the wide tensor sharded by rows, then by columns, counting the bytes the engine
    reads for each load (at the engine's read function) and checking the values."""
    from torch.distributed.tensor import Shard

    from fastpersist import _core
    from fastpersist.integrations.dcp import FastPersistReader

    engine_read = _core.read_ranges_into
    counted = {"bytes": 0}

    def counting_read(ranges: Any, dest: Any, **kwargs: Any) -> int:
        nbytes = engine_read(ranges, dest, **kwargs)
        counted["bytes"] += nbytes
        return nbytes

    _core.read_ranges_into = counting_read  # type: ignore[assignment]

    def load() -> dict[str, Any]:
        results: dict[str, Any] = {}
        for name, placement in (("rows", Shard(0)), ("cols", Shard(1))):
            target = _wide_state(placement)
            target["w"].to_local().zero_()
            target["step"] = 0
            counted["bytes"] = 0
            dist.barrier()
            dcp.load(target, storage_reader=FastPersistReader(path))
            local = target["w"].to_local()
            size = WIDE_SHAPE[placement.dim] // world
            expected = wide_weight().narrow(placement.dim, rank * size, size)
            results[name] = {
                "bytes_read": counted["bytes"],
                "share_bytes": local.numel() * local.element_size(),
                "equal": bool(torch.equal(local, expected)),
                "step": target["step"],
            }
        return results

    report_rank(rank, world, init_file, workdir, load)


def save_rank_local(rank: int, world: int, init_file: str, workdir: str, path: str) -> None:
    """Tries ``dcp.save(use_collectives=False)`` on every rank; reports the error each got."""
    from fastpersist.integrations.dcp import FastPersistWriter

    def save() -> dict[str, Any]:
        try:
            dcp.save({"w": torch.ones(4) * rank}, storage_writer=FastPersistWriter(path), use_collectives=False)
        except Exception as e:
            return {"error": repr(e)}
        return {"error": None}

    report_rank(rank, world, init_file, workdir, save)
