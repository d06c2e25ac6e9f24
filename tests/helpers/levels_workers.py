"""Inside each rank of the partner-level tests (tests/levels/test_levels.py): 4 ranks as 2 simulated
nodes of 2 (``FASTPERSIST_NODE``), each node its own root."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

import fastpersist as fp

import training
from gloo import report_rank

RANKS_PER_NODE = 2


def node_of(rank: int) -> str:
    return f"node{rank // RANKS_PER_NODE}"


def node_root(workdir: str, rank: int) -> str:
    return os.path.join(workdir, node_of(rank))


def step_state(step: int, rank: int, sharded: bool, n: int = 70_000) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step * 100 + (rank if sharded else 0))
    return {
        "w": torch.randn(n, generator=gen),
        "b": torch.randn(300, generator=gen).to(torch.bfloat16),
        "step": step,
        "rank": rank if sharded else -1,
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def checkpointer(workdir: str, rank: int, sharded: bool, backend: str, keep: int = 2) -> fp.Checkpointer:
    config = fp.Config(chunk_bytes=64 << 10, timeout_s=60, backend=backend)  # type: ignore[arg-type]
    return fp.Checkpointer(
        node_root(workdir, rank),
        every=1,
        keep=keep,
        config=config,
        group=dist.group.WORLD,
        sharded=sharded,
        levels=[fp.Partner(replicas=1)],
    )


def save_steps(
    rank: int, world: int, init_file: str, workdir: str, sharded: bool, backend: str, steps: list[int], n: int = 70_000
) -> None:
    os.environ["FASTPERSIST_NODE"] = node_of(rank)

    def compute() -> Any:
        with checkpointer(workdir, rank, sharded, backend) as ck:
            for step in steps:
                ck.save(step, step_state(step, rank, sharded, n))
                ck.wait_staged()
        dist.barrier()  # every node leader has retired its old steps
        return {"steps": ck.steps(), "levels": ck.levels()}

    report_rank(rank, world, init_file, workdir, compute)


def save_device_steps(
    rank: int, world: int, init_file: str, workdir: str, sharded: bool, backend: str, steps: list[int]
) -> None:
    """save_steps with the state's tensors staged by a fake copy engine through the arena, each
    step waited for (a device state's step due while a save still writes would be skipped)."""
    from fastpersist.gpu.copiers import use_copier

    from fake_cuda import LaterCopier

    os.environ["FASTPERSIST_NODE"] = node_of(rank)

    def compute() -> Any:
        with use_copier(lambda t: True, LaterCopier), checkpointer(workdir, rank, sharded, backend) as ck:
            for step in steps:
                ck.save(step, step_state(step, rank, sharded))
                ck.wait()
            from_device = ck._from_device
        dist.barrier()
        return {"steps": ck.steps(), "levels": ck.levels(), "from_device": from_device}

    report_rank(rank, world, init_file, workdir, compute)


def restore(rank: int, world: int, init_file: str, workdir: str, sharded: bool, backend: str, n: int = 70_000) -> None:
    os.environ["FASTPERSIST_NODE"] = node_of(rank)

    def compute() -> Any:
        ck = checkpointer(workdir, rank, sharded, backend)
        latest = ck.latest()
        state = ck.load()
        step = int(state["step"])
        return {"latest": latest, "step": step, "same": same(state, step_state(step, rank, sharded, n))}

    report_rank(rank, world, init_file, workdir, compute)


def restore_into(rank: int, world: int, init_file: str, workdir: str, sharded: bool) -> None:
    """``ck.load(out=...)``: a state of the wrong shape is refused untouched, then the right one is
    filled in place (each rank from its own root, or its partner's copy)."""
    os.environ["FASTPERSIST_NODE"] = node_of(rank)

    def compute() -> Any:
        ck = checkpointer(workdir, rank, sharded, "threads")
        wrong = {"w": torch.full((5,), 7.0)}
        try:
            ck.load(out=wrong)
            refused = False
        except ValueError as e:
            refused = "out= tensor" in str(e)
        out = {"w": torch.zeros(70_000), "b": torch.zeros(300, dtype=torch.bfloat16)}
        state = ck.load(out=out)
        step = int(state["step"])
        return {
            "refused_untouched": refused and bool(torch.equal(wrong["w"], torch.full((5,), 7.0))),
            "in_place": state["w"] is out["w"] and state["b"] is out["b"],
            "same": same(state, step_state(step, rank, sharded)),
            "step": step,
        }

    report_rank(rank, world, init_file, workdir, compute)


def save_with_a_partner_killed(
    rank: int, world: int, init_file: str, workdir: str, sharded: bool, backend: str, victim: int
) -> None:
    """Steps 1-2 save; during step 3's copies to partners, rank `victim` is killed (SIGKILL)."""
    os.environ["FASTPERSIST_NODE"] = node_of(rank)
    from fastpersist.saving import partner_copies as partner

    original = partner.send_and_receive

    def dying(*args: Any, **kwargs: Any) -> Any:
        if step_now[0] == 3 and rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    step_now = [0]
    partner.send_and_receive = dying  # type: ignore[assignment]

    def compute() -> Any:
        ck = checkpointer(workdir, rank, sharded, backend)
        outcome = "committed"
        for step in (1, 2, 3):
            step_now[0] = step
            ck.save(step, step_state(step, rank, sharded))
            try:
                ck.wait()
            except fp.GroupSaveError as e:
                outcome = f"{type(e).__name__}: {e}"
        return {"outcome": outcome, "steps": ck.steps()}

    report_rank(rank, world, init_file, workdir, compute, destroy=False)


#: How long the survivors of a rank killed during a restore may take to raise (the control group's
#: timeout_s is 60 s in these tests).
RESTORE_KILLED_BOUND_S = 15.0


def restore_with_a_rank_killed(
    rank: int, world: int, init_file: str, workdir: str, backend: str, victim: int, kill_at: int
) -> None:
    """``ck.load()`` of a replicated step, rank `victim` SIGKILLed as it enters its `kill_at`-th
    broadcast of the restore's bytes: each survivor reports what it raised and how long it waited."""
    os.environ["FASTPERSIST_NODE"] = node_of(rank)
    broadcast = dist.broadcast
    calls = [0]

    def dying(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return broadcast(*args, **kwargs)

    def compute() -> Any:
        ck = checkpointer(workdir, rank, False, backend)
        if rank == victim:
            dist.broadcast = dying  # type: ignore[assignment]
        started = time.monotonic()
        try:
            ck.load()
            outcome = "restored"
        except Exception as e:
            outcome = f"{type(e).__name__}: {e}"
        return {"outcome": outcome, "seconds": time.monotonic() - started, "timeout_s": ck.config.timeout_s}

    report_rank(rank, world, init_file, workdir, compute, destroy=False)
    # A rank that raised stays alive, its connections open (a training process that catches the
    # error and goes on), until every survivor has raised too: their waits cannot end by its exit.
    deadline = time.monotonic() + 3 * RESTORE_KILLED_BOUND_S
    survivors = [r for r in range(world) if r != victim]
    while time.monotonic() < deadline and not all(
        os.path.exists(os.path.join(workdir, f"result-{r}.json")) for r in survivors
    ):
        time.sleep(0.05)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(
    rank: int, world: int, init_file: str, workdir: str, sharded: bool, backend: str, until: int, die: bool
) -> None:
    """The README recipe on TinyGPT: resume from ck.load() if there is a step, train to `until`,
    saving every step; with `die`, SIGKILL this rank right after the last save started."""
    os.environ["FASTPERSIST_NODE"] = node_of(rank)
    seed = 1 + (rank if sharded else 0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ck = checkpointer(workdir, rank, sharded, backend)
    training.seed_all(seed)
    model, opt, sched = training.make_run(seed)
    start = 0
    if ck.latest() is not None:
        model, opt, sched, start = training.restore(ck.load(), seed)
    losses = []
    for step in range(start + 1, until + 1):
        ck.wait_staged()
        losses.append(training.train_step(model, opt, sched))
        ck.save(step, training.training_state(model, opt, sched, step))
    result = {"start": start, "losses": losses, "digest": digest(model)}
    with open(os.path.join(workdir, f"result-{rank}.json"), "w") as f:
        import json

        json.dump(result, f)
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    ck.close()
    dist.destroy_process_group()


def reference(seed: int, until: int) -> tuple[list[float], str]:
    """The same training without any checkpoint: the losses and final digest to match."""
    training.seed_all(seed)
    model, opt, sched = training.make_run(seed)
    losses = [training.train_step(model, opt, sched) for _ in range(until)]
    return losses, digest(model)


def campaign_state(step: int, rank: int, sharded: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step * 100 + (rank if sharded else 0))
    return {"w": torch.randn(1 << 21, generator=gen), "step": step}


def campaign_run(rank: int, world: int, init_file: str, workdir: str, sharded: bool) -> None:
    """One life of a job that is SIGKILLed at a random moment: restore and check the newest
    step (reported at once), then save step after step until killed."""
    global RANKS_PER_NODE
    RANKS_PER_NODE = 1
    os.environ["FASTPERSIST_NODE"] = node_of(rank)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ck = checkpointer(workdir, rank, sharded, "auto")
    latest = ck.latest()
    result: dict[str, Any] = {"latest": latest, "same": True}
    if latest is not None:
        state = ck.load()
        result["same"] = int(state["step"]) == latest and same(state, campaign_state(latest, rank, sharded))
    import json

    with open(os.path.join(workdir, f"result-{rank}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.rename(os.path.join(workdir, f"result-{rank}.json.tmp"), os.path.join(workdir, f"result-{rank}.json"))
    step = latest or 0
    while True:
        step += 1
        ck.save(step, campaign_state(step, rank, sharded))
        ck.wait()


def refused(rank: int, world: int, init_file: str, workdir: str, replicas: int, stripes: bool) -> None:
    """A save that the partner level refuses (too many replicas for the nodes, or stripes): the
    error, the same on every rank, and nothing written."""
    os.environ["FASTPERSIST_NODE"] = node_of(rank)

    def compute() -> Any:
        config = fp.Config(chunk_bytes=64 << 10, timeout_s=60, stripes=[workdir] if stripes else None)
        ck = fp.Checkpointer(
            node_root(workdir, rank), config=config, group=dist.group.WORLD, levels=[fp.Partner(replicas=replicas)]
        )
        try:
            ck.save(1, step_state(1, rank, False))
            ck.wait()
        except ValueError as e:
            return {"error": str(e), "steps": ck.steps()}
        return {"error": "", "steps": ck.steps()}

    report_rank(rank, world, init_file, workdir, compute)


def _remote_checkpointer(workdir: str, rank: int, remote: str | None = None) -> fp.Checkpointer:
    config = fp.Config(chunk_bytes=64 << 10, timeout_s=60)
    return fp.Checkpointer(
        node_root(workdir, rank),
        every=1,
        keep=2,
        config=config,
        group=dist.group.WORLD,
        levels=[fp.Partner(replicas=1), fp.Remote(remote or os.path.join(workdir, "remote"), every=2)],
    )


def save_with_remote(
    rank: int, world: int, init_file: str, workdir: str, steps: list[int], remote: str | None = None
) -> None:
    os.environ["FASTPERSIST_NODE"] = node_of(rank)

    def compute() -> Any:
        with _remote_checkpointer(workdir, rank, remote) as ck:
            for step in steps:
                ck.save(step, step_state(step, rank, False))
                ck.wait_staged()
        return {"remote": ck.levels()["remote"]["steps"]}

    report_rank(rank, world, init_file, workdir, compute)


def restore_with_remote(rank: int, world: int, init_file: str, workdir: str, remote: str | None = None) -> None:
    os.environ["FASTPERSIST_NODE"] = node_of(rank)

    def compute() -> Any:
        ck = _remote_checkpointer(workdir, rank, remote)
        latest = ck.latest()
        state = ck.load()
        step = int(state["step"])
        ck.save(step + 1, step_state(step + 1, rank, False))
        ck.close()
        dist.barrier()
        return {"latest": latest, "step": step, "same": same(state, step_state(step, rank, False)), "local": ck.steps()}

    report_rank(rank, world, init_file, workdir, compute)


def save_with_uneven_drains(rank: int, world: int, init_file: str, workdir: str) -> None:
    """Rank 1's drain is throttled to ~1 s a step, the others' are not: each rank replaces its
    waiting step on its own timing, yet every drain must take the same step on every rank."""
    os.environ["FASTPERSIST_NODE"] = node_of(rank)

    def compute() -> Any:
        ck = fp.Checkpointer(
            node_root(workdir, rank),
            keep=2,
            # A rank waiting for a step the others skipped would wait timeout_s and fail; 8 s was
            # once not enough for 4 ranks' drains on 2 busy cores (the full suite), so 20.
            config=fp.Config(chunk_bytes=64 << 10, timeout_s=20),
            group=dist.group.WORLD,
            levels=[
                fp.Partner(replicas=1),
                fp.Remote(os.path.join(workdir, "remote"), every=1, bytes_per_s=100_000 if rank == 1 else None),
            ],
        )
        for step in range(1, 9):  # training goes on while the drains run, at their own speeds
            ck.save(step, step_state(step, rank, False))
            ck.wait()
            time.sleep(0.25)
        error = ""
        try:
            ck.close()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        return {"error": error, "drained": ck.levels()["remote"]["steps"]}

    report_rank(rank, world, init_file, workdir, compute)


def plain_group_with_remote(rank: int, world: int, init_file: str, workdir: str) -> None:
    """A plain group save (replicas=0, one root every rank writes into) of a stream of one chunk
    drained to a directory: only the last writer has a file, and rank 0 must drain it."""

    def compute() -> Any:
        ck = fp.Checkpointer(
            os.path.join(workdir, "shared-root"),
            config=fp.Config(chunk_bytes=64 << 10, timeout_s=30),
            group=dist.group.WORLD,
            levels=[fp.Remote(os.path.join(workdir, "remote"), every=1)],
        )
        ck.save(1, step_state(1, rank, False, 1000))
        ck.wait()
        ck.close()
        return {"remote": ck.levels()["remote"]["steps"]}

    report_rank(rank, world, init_file, workdir, compute)


def differing_state(rank: int, differ: bool, n: int = 70_000) -> dict[str, Any]:
    """A replicated state of the same size on every rank; with `differ`, each rank's bytes differ."""
    return {"w": torch.arange(n, dtype=torch.float32) + (rank if differ else 0), "step": 1}


def w_digest(state: dict[str, Any]) -> str:
    return hashlib.sha256(state["w"].numpy().tobytes()).hexdigest()


def save_replicated_counting_transfers(
    rank: int, world: int, init_file: str, workdir: str, differ: bool, backend: str
) -> None:
    """Saves step 1 of a replicated state with replicas=1; reports how many share transfers
    the partner step sent over the group, and the digest of what a load returns."""
    os.environ["FASTPERSIST_NODE"] = node_of(rank)
    from fastpersist.saving import partner_copies as partner

    original = partner.send_and_receive
    transfers: list[int] = []

    def counting(pg: Any, me: int, sent: list[Any], **kwargs: Any) -> Any:
        transfers.append(len(sent))
        return original(pg, me, sent, **kwargs)

    partner.send_and_receive = counting  # type: ignore[assignment]

    def compute() -> Any:
        with checkpointer(workdir, rank, False, backend) as ck:
            ck.save(1, differing_state(rank, differ))
            ck.wait()
            return {"transfers": transfers, "digest": w_digest(ck.load())}

    report_rank(rank, world, init_file, workdir, compute)


def restore_digest(rank: int, world: int, init_file: str, workdir: str, backend: str) -> None:
    os.environ["FASTPERSIST_NODE"] = node_of(rank)

    def compute() -> Any:
        ck = checkpointer(workdir, rank, False, backend)
        return {"latest": ck.latest(), "digest": w_digest(ck.load())}

    report_rank(rank, world, init_file, workdir, compute)


def drain_with_a_rank_failing(rank: int, world: int, init_file: str, workdir: str) -> None:
    """2 nodes of 1 rank, replicas=1, a remote directory: step 1 drains; rank 1's data file of
    step 2 cannot be written on the remote (a directory stands there). Reports what close()
    raised on this rank, its errno, how long it took, and the remote steps."""
    os.environ["FASTPERSIST_NODE"] = f"node{rank}"

    def compute() -> Any:
        ck = fp.Checkpointer(
            os.path.join(workdir, f"node{rank}"),
            keep=2,
            config=fp.Config(chunk_bytes=64 << 10, timeout_s=60),
            group=dist.group.WORLD,
            levels=[fp.Partner(replicas=1), fp.Remote(os.path.join(workdir, "remote"), every=1)],
        )
        ck.save(1, step_state(1, rank, False))
        ck.close()
        os.makedirs(os.path.join(workdir, "remote", "step-00000002", "data-w1-s0.bin"), exist_ok=True)
        ck.save(2, step_state(2, rank, False))
        started = time.monotonic()
        try:
            ck.close()
            error, code = "", None
        except OSError as e:
            error, code = f"{type(e).__name__}: {e}", e.errno
        return {
            "error": error,
            "errno": code,
            "seconds": time.monotonic() - started,
            "remote": ck.levels()["remote"]["steps"],
        }

    report_rank(rank, world, init_file, workdir, compute)
