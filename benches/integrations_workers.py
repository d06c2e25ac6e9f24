"""The stacks' sides of benches/integrations.py: DeepSpeed's spawned ranks, the Trainer and Lightning runs.

Each run returns ``{"loop_s", "ckpts", "durable_s", "bytes"}`` (the no-checkpoint loop only the
first two); benches/integrations.py's docstring says what each one measures.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import shutil
import time
import traceback
from typing import Any, Protocol

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports DeepSpeed

import torch
import torch.nn.functional as F

NONE = "no checkpoint"
DS_WORLD = 2
DS_TORCH, DS_FAST, DS_DECOUPLED = "TorchCheckpointEngine (default)", "FastCheckpointEngine", "DecoupledCheckpointEngine"
FP_BLOCKING, FP_DECOUPLED = "fastpersist install()", "fastpersist install(decoupled=True)"
DS_WRITERS = (DS_TORCH, DS_FAST, DS_DECOUPLED, FP_BLOCKING, FP_DECOUPLED)
HF_STOCK, HF_OURS = "Trainer (stock)", "FastPersistTrainer"
PL_TORCH, PL_ASYNC, PL_OURS = (
    "TorchCheckpointIO (default)",
    "AsyncCheckpointIO(TorchCheckpointIO)",
    "FastPersistAsyncCheckpointIO",
)
NO_GRAD_NOTE = (
    "every writer's save_checkpoint runs under torch.no_grad(): without it DeepSpeed 0.19.8's "
    "DecoupledCheckpointEngine fails at ZeRO 1 and 2 (the optimizer's state_dict holds slices of its fp32 "
    "partitions, non-leaf tensors that require grad, which its queue to the writer process refuses to pickle)"
)
AIO_HINT = "DeepSpeed's async_io op did not load (it needs libaio: apt-get install libaio-dev, then rerun)"


class Stack(Protocol):
    title: str
    writers: list[str]

    def run(self, name: str, rep: int) -> dict[str, Any]: ...


# ------------------------------------------------------------------------------- shared


def fsync_tree(path: str) -> None:
    """fsyncs every file and directory under `path` (a file or a directory), and its parent."""
    paths = [path]
    if os.path.isdir(path):
        for here, _dirs, files in os.walk(path):
            paths += [os.path.join(here, n) for n in files] + [here]
    for p in [*paths, os.path.dirname(os.path.abspath(path))]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def tree_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(here, n)) for here, _d, files in os.walk(path) for n in files)


def mlp_width(params: int) -> int:
    return max(64, round(math.sqrt(params / 8) / 64) * 64)


def mlp(params: int) -> torch.nn.Module:
    """8 square Linear layers of about `params` parameters in all, the same weights every call."""
    width = mlp_width(params)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(8):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def batches(width: int, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, width, generator=g), torch.randn(8, width, generator=g)) for _ in range(steps)]


def ckpt_bytes_estimate(params: int) -> int:
    """Weights and Adam's two moments in fp32, plus room for the rest."""
    return 12 * params + (16 << 20)


# ---------------------------------------------------------------------------- DeepSpeed


def page_aligned_copy(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    nbytes = self.numel() * self.element_size()
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    offset = -raw.data_ptr() % 4096
    out = raw[offset : offset + nbytes].view(self.dtype).view(self.shape)
    out.copy_(self)
    return out


def stand_ins() -> list[str]:
    """Where this machine has no CUDA, gives DeepSpeed's fast writer CPU versions of its two
    CUDA-only steps; returns what was stood in for."""
    import deepspeed.io.fast_file_writer as ffw
    from deepspeed.ops.op_builder import UtilsBuilder

    os.environ[STAND_INS_ENV] = "1"  # DecoupledCheckpointEngine's writer process (spawned) applies them at import
    notes = []
    if not torch.cuda.is_available():
        torch.Tensor.pin_memory = page_aligned_copy  # type: ignore[method-assign, assignment]
        notes.append(
            "stand-in: Tensor.pin_memory() returns a page-aligned copy, unpinned (no CUDA here; FastCheckpointEngine "
            "pins its io buffer, and pinned host memory is page-aligned, as its O_DIRECT writes need)"
        )
    try:
        UtilsBuilder().load()
    except Exception as e:

        class ByteViews:
            @staticmethod
            def cast_to_byte_tensor(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
                return [t.reshape(-1).view(torch.uint8) for t in tensors]

        class Builder:
            def load(self) -> ByteViews:
                return ByteViews()

        ffw.UtilsBuilder = Builder
        notes.append(
            f"stand-in: UtilsBuilder's cast_to_byte_tensor is a plain-torch byte view of each tensor "
            f"(DeepSpeed's op: {type(e).__name__}: {e})"
        )
    return notes


STAND_INS_ENV = "FASTPERSIST_BENCH_DS_STAND_INS"


def aio_loads() -> str | None:
    """None if DeepSpeed's async_io op loads (built the first time); else why not."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    try:
        if not AsyncIOBuilder().is_compatible(verbose=False):
            return AIO_HINT
        AsyncIOBuilder().load(verbose=False)
    except Exception as e:
        return f"{AIO_HINT}: {type(e).__name__}: {e}"
    return None


def ds_config(name: str, stage: int, data_parallel: str, precision: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "bf16": {"enabled": precision == "bf16"},
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1 << 30,
    }
    if name in (DS_FAST, DS_DECOUPLED):
        # DeepSpeed 0.19.8 needs a data_parallel unit without a model-parallel unit (mpu): its
        # default (None) reads UniversalParallelInfo.dp_rank, which does not exist.
        writer = {"type": "fast", "decoupled": name == DS_DECOUPLED, "data_parallel": data_parallel}
        config["checkpoint"] = {"writer": writer}
    return config


def ds_drain(engine: Any) -> None:
    """Commits a decoupled engine's open tag (what DeepSpeed does in the next step())."""
    ce = engine.checkpoint_engine
    if ce.is_decoupled() and ce.get_commit_info() is not None:
        engine._commit_decoupled_checkpoint()


def ds_one(name: str, rep: int, root: str, o: dict[str, Any], data: list[Any]) -> dict[str, Any]:
    import deepspeed
    import torch.distributed as dist

    import fastpersist as fp
    from fastpersist.integrations import deepspeed as fp_deepspeed

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    model = mlp(o["params"])
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=ds_config(name, o["zero_stage"], o["ds_data_parallel"], o["ds_precision"]),
    )
    if name in (FP_BLOCKING, FP_DECOUPLED):
        fp_deepspeed.install(engine, decoupled=name == FP_DECOUPLED, config=fp.Config())
    save_dir = os.path.join(root, f"ds-{rep}-{DS_WRITERS.index(name) if name in DS_WRITERS else 'none'}")
    result: dict[str, Any] = {}
    if name != NONE:  # untimed: DecoupledCheckpointEngine's writer process starts (imports DeepSpeed), pools fill
        with torch.no_grad():
            engine.save_checkpoint(save_dir, tag="warmup")
        ds_drain(engine)
    dist.barrier()
    start = time.perf_counter()
    ckpts = 0
    dtype = torch.bfloat16 if o["ds_precision"] == "bf16" else torch.float32
    for step, (x, y) in enumerate(data):
        loss = F.mse_loss(engine(x.to(dtype)), y.to(dtype))
        engine.backward(loss)
        engine.step()
        if name != NONE and (step + 1) % o["every"] == 0:
            with torch.no_grad():  # see NO_GRAD_NOTE
                engine.save_checkpoint(save_dir, tag=f"step{step + 1}")
            ckpts += 1
    ds_drain(engine)
    result |= {"loop_s": slowest(time.perf_counter() - start), "ckpts": ckpts}
    if name != NONE:
        tag_dir = os.path.join(save_dir, "durable")
        os.sync()  # untimed: the loop's checkpoints still in the page cache are not written back meanwhile
        dist.barrier()
        start = time.perf_counter()
        with torch.no_grad():
            engine.save_checkpoint(save_dir, tag="durable")
        ds_drain(engine)
        dist.barrier()  # every rank's files are written before any rank fsyncs them
        fsync_tree(tag_dir)
        result["durable_s"] = slowest(time.perf_counter() - start)
        result["bytes"] = tree_bytes(tag_dir)
    engine.destroy()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(save_dir, ignore_errors=True)
    del engine, model
    gc.collect()
    return result


def deepspeed_rank(rank: int, root: str, o: dict[str, Any], out: str) -> None:
    """One DeepSpeed rank: every writer (and the no-checkpoint loop) for every rep; rank 0 writes
    the runs, also those done before a failure. A row that fails on a rank ends the run: the ranks'
    collectives no longer match, and the other rank's next one fails (after ``--ds-timeout-s`` at
    most) rather than hanging."""
    import datetime
    import json

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(DS_WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(DS_WORLD))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # read, never dialled: gloo joins by file
    # One machine: DeepSpeed's launcher sets these, and its fast writer reads them.
    os.environ.update(CROSS_RANK="0", CROSS_SIZE="1")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // DS_WORLD))
    timeout = datetime.timedelta(seconds=o["ds_timeout_s"])
    dist.init_process_group("gloo", init_method=f"file://{root}/ds-pg", rank=rank, world_size=DS_WORLD, timeout=timeout)
    runs: list[dict[str, Any]] = []
    try:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, timeout=timeout)
        started = time.perf_counter()
        why_no_aio = aio_loads()
        aio_s = time.perf_counter() - started
        flag = torch.tensor([0 if why_no_aio is None else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and why_no_aio is None:
            why_no_aio = f"{AIO_HINT} (on another rank)"
        notes = stand_ins() if why_no_aio is None else []
        notes.append(NO_GRAD_NOTE)
        notes.append(f"async_io op: {'loaded' if why_no_aio is None else 'unavailable'} in {aio_s:.1f} s")
        width = mlp_width(o["params"])
        data = batches(width, o["steps"], seed=rank)
        order = [NONE, *DS_WRITERS]
        ds_one(NONE, -1, root, o, data)  # a warm-up, not counted: the first engine pays for first-call set-up
        for rep in range(o["reps"]):
            shift = rep % len(order)
            for name in order[shift:] + order[:shift]:
                if rank == 0:
                    print(f"deepspeed: rep {rep} {name} ...", flush=True)
                if name in (DS_FAST, DS_DECOUPLED) and why_no_aio is not None:
                    runs.append({"rep": rep, "writer": name, "skipped": why_no_aio})
                    continue
                try:
                    runs.append({"rep": rep, "writer": name, "notes": notes, **ds_one(name, rep, root, o, data)})
                except Exception as e:
                    runs.append(
                        {"rep": rep, "writer": name, "skipped": f"failed on rank {rank}: {type(e).__name__}: {e}"}
                    )
                    raise
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        if rank == 0:
            with open(out, "w") as f:
                json.dump(runs, f)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


# ------------------------------------------------------------------ Hugging Face Trainer


class TrainStart:
    """When training began: the Trainer's set-up (model wrapping, optimizer, data loader) is
    outside the loop's time, whose variation would otherwise swamp a checkpoint's cost."""

    def __init__(self) -> None:
        self.start_s = float("nan")

    def now(self) -> None:
        self.start_s = time.perf_counter()


class HFStack:
    """The stock Trainer against FastPersistTrainer on a GPT-2 built from a config."""

    def __init__(self, o: dict[str, Any], root: str) -> None:
        import transformers

        self.o, self.root = o, root
        layers = 2 if o["params"] < 5e6 else 6 if o["params"] < 50e6 else 12
        vocab, positions = 8192 if o["params"] >= 5e6 else 1024, 64
        # GPT-2's parameters: 12 d^2 per layer, (vocab + positions) d for the embeddings.
        a, b = 12 * layers, vocab + positions
        d = (-b + math.sqrt(b * b + 4 * a * o["params"])) / (2 * a)
        width = max(64, round(d / 64) * 64)
        self.config = transformers.GPT2Config(
            n_embd=width, n_layer=layers, n_head=width // 64, vocab_size=vocab, n_positions=positions,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        # Its "Writing model shards" bar at every save.
        transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (2 * o["steps"], positions), generator=g)
        self.data = [{"input_ids": row, "labels": row} for row in ids]
        params = sum(p.numel() for p in transformers.GPT2LMHeadModel(self.config).parameters())
        shape = f"{layers} layers, width {width}, {params / 1e6:.1f}M parameters"
        self.title = f"GPT-2 ({shape}), batch 2 x {positions} tokens, AdamW"
        self.writers = [HF_STOCK, HF_OURS]

    def run(self, name: str, rep: int) -> dict[str, Any]:
        import transformers

        from fastpersist.integrations.hf_trainer import FastPersistTrainer

        out = os.path.join(self.root, f"hf-{rep}-{name.split()[0]}")
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=self.o["steps"], per_device_train_batch_size=2, learning_rate=1e-4,
            save_strategy="no" if name == NONE else "steps", save_steps=self.o["every"], logging_strategy="no",
            report_to="none", use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0,
        )  # fmt: skip
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(self.config)
        cls = FastPersistTrainer if name == HF_OURS else transformers.Trainer
        trainer: Any = cls(model=model, args=args, train_dataset=self.data)
        trainer.remove_callback(transformers.PrinterCallback)  # its metrics line at the end of train()
        clock = TrainStart()

        class Clock(transformers.TrainerCallback):
            def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
                clock.now()

        trainer.add_callback(Clock())
        trainer.train()  # FastPersistTrainer's waits for its checkpoint in flight before returning
        result: dict[str, Any] = {"loop_s": time.perf_counter() - clock.start_s}
        result["ckpts"] = len([n for n in os.listdir(out) if n.startswith("checkpoint-")]) if name != NONE else 0
        if name != NONE:
            trainer.state.global_step += 1000
            path = os.path.join(out, f"checkpoint-{trainer.state.global_step}")
            os.sync()  # untimed: the loop's checkpoints still in the page cache are not written back meanwhile
            start = time.perf_counter()
            trainer._save_checkpoint(model, trial=None)
            if name == HF_OURS:
                trainer.wait_for_checkpoint()
            fsync_tree(path)
            result |= {"durable_s": time.perf_counter() - start, "bytes": tree_bytes(path)}
        del trainer, model
        gc.collect()
        shutil.rmtree(out, ignore_errors=True)
        return result


# ------------------------------------------------------------------------------ Lightning


class LightningStack:
    """Lightning's checkpoint IO plug-ins against FastPersistAsyncCheckpointIO on the MLP."""

    def __init__(self, o: dict[str, Any], root: str) -> None:
        for name in ("lightning.pytorch", "lightning.fabric"):  # "GPU available: False", tips: one per fit
            logging.getLogger(name).setLevel(logging.WARNING)
        self.o, self.root = o, root
        self.width = mlp_width(o["params"])
        self.data = batches(self.width, o["steps"], seed=0)
        params = sum(p.numel() for p in mlp(o["params"]).parameters())
        self.title = f"MLP (8 layers, width {self.width}, {params / 1e6:.1f}M parameters), batch 8, Adam, one process"
        self.writers = [PL_TORCH, PL_ASYNC, PL_OURS]

    def io(self, name: str) -> Any:
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        import fastpersist as fp
        from fastpersist.integrations.lightning import FastPersistAsyncCheckpointIO

        if name == PL_ASYNC:
            return AsyncCheckpointIO(TorchCheckpointIO())
        if name == PL_OURS:  # a pool of the checkpoint's size, as docs/integrations.md's recipe says
            return FastPersistAsyncCheckpointIO(config=fp.Config(pool_bytes=ckpt_bytes_estimate(self.o["params"])))
        return TorchCheckpointIO()

    def run(self, name: str, rep: int) -> dict[str, Any]:
        import lightning.pytorch as pl

        o = self.o
        params = o["params"]

        class Model(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = mlp(params)

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                x, y = batch
                return F.mse_loss(self.net(x), y)

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.Adam(self.parameters(), lr=1e-4)

        out = os.path.join(self.root, f"pl-{rep}-{name.split()[0]}")
        saving = name != NONE
        clock = TrainStart()
        callbacks: list[pl.Callback] = [
            pl.callbacks.ModelCheckpoint(dirpath=out, every_n_train_steps=o["every"], save_top_k=-1)
        ]

        class Clock(pl.Callback):
            def on_train_start(self, *args: Any, **kwargs: Any) -> None:
                clock.now()

        callbacks = [Clock(), *callbacks] if saving else [Clock()]
        trainer = pl.Trainer(
            max_steps=o["steps"], max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
            accelerator="cpu", devices=1, enable_checkpointing=saving, callbacks=callbacks,
            plugins=[self.io(name)] if name in (PL_ASYNC, PL_OURS) else [],
        )  # fmt: skip
        model = Model()
        # fit's teardown waits for an overlapped plug-in's saves in flight.
        trainer.fit(model, torch.utils.data.DataLoader(self.data, batch_size=None))  # type: ignore[arg-type]
        result: dict[str, Any] = {"loop_s": time.perf_counter() - clock.start_s}
        result["ckpts"] = len([n for n in os.listdir(out) if n.endswith(".ckpt")]) if saving else 0
        if saving:
            # The plug-in alone, on the Trainer's own checkpoint dict: a fresh instance, so that
            # fit's teardown leaves nothing of it.
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            io, path = self.io(name), os.path.join(out, "durable.ckpt")
            os.sync()  # untimed: the loop's checkpoints still in the page cache are not written back meanwhile
            start = time.perf_counter()
            io.save_checkpoint(checkpoint, path)
            io.teardown()
            fsync_tree(path)
            result |= {"durable_s": time.perf_counter() - start, "bytes": tree_bytes(path)}
        del trainer, model
        gc.collect()
        shutil.rmtree(out, ignore_errors=True)
        return result


if os.environ.get(STAND_INS_ENV) == "1":  # a process spawned by a DeepSpeed rank: the rank's stand-ins again
    stand_ins()
