"""Ranks of the sharded Hugging Face export test (tests/interop/test_hf_export.py), on gloo."""

from __future__ import annotations

import os

import torch

from gloo import report_rank


def tiny_gpt2() -> torch.nn.Module:
    """A small GPT-2 built from a config (nothing downloaded), the same on every process."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    return transformers.GPT2LMHeadModel(config).eval()


def sharded_save(rank: int, world: int, init_file: str, workdir: str) -> None:
    """Each rank saves half of the model's tensors (and both the tied embedding) as its shard,
    through a sharded Checkpointer; then a shard pair that disagrees on one name."""
    import torch.distributed as dist

    import fastpersist as fp

    def compute() -> dict[str, int]:
        state = tiny_gpt2().state_dict()
        names = list(state)
        mine = {k: state[k] for i, k in enumerate(names) if i % world == rank or k == "transformer.wte.weight"}
        ck = fp.Checkpointer(os.path.join(workdir, "root"), group=dist.group.WORLD, sharded=True)
        ck.save(5, {"model": mine, "step": 5})
        ck.close()
        differ = {"model": {"w": torch.full((2,), float(rank))}}
        fp.save(differ, os.path.join(workdir, "differ"), group=dist.group.WORLD, sharded=True)
        return {"tensors": len(mine)}

    report_rank(rank, world, init_file, workdir, compute)


def dcp_sharded_save(rank: int, world: int, init_file: str, workdir: str) -> None:
    """DCP saves the model with every 2-D weight split over the ranks (a DTensor, Shard(1)): each
    such tensor is stored as one chunk per rank, in each rank's own data file."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fastpersist.integrations.dcp import FastPersistWriter

    def compute() -> dict[str, int]:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        state: dict[str, torch.Tensor] = {}
        for k, v in tiny_gpt2().state_dict().items():
            state[k] = distribute_tensor(v, mesh, [Shard(1)]) if v.dim() == 2 else v
        dcp.save({"model": state}, storage_writer=FastPersistWriter(os.path.join(workdir, "dcp")))
        return {"tensors": len(state)}

    report_rank(rank, world, init_file, workdir, compute)
