"""A process that replaces one checkpoint over and over (for the load-while-replacing tests)."""

from __future__ import annotations

import time

import torch

import fastpersist as fp

#: Tensors per state, and elements per tensor (4 x 256 KiB: several chunks and windows).
TENSORS = 4
ELEMS = 64 << 10


def stepped_state(step: int) -> dict[str, object]:
    """A state whose every tensor and value says which save it came from."""
    state: dict[str, object] = {f"w{i}": torch.full((ELEMS,), float(step * 10 + i)) for i in range(TENSORS)}
    state["step_t"] = torch.tensor(step)
    state["step"] = step
    return state


def replace_in_a_loop(path: str, backend: str, seconds: float, saves: object) -> None:
    """Saves steps 1, 2, 1, 2, ... to `path` for `seconds`; puts the count of saves in `saves`."""
    config = fp.Config(backend=backend, chunk_bytes=64 << 10, pool_bytes=1 << 20, queue_depth=4, durable=False)
    states = {k: stepped_state(k) for k in (1, 2)}
    n, stop = 0, time.monotonic() + seconds
    while time.monotonic() < stop:
        fp.save(states[1 + n % 2], path, config=config)
        n += 1
    fp.wait_removed()  # the replaced trees, before the count says the saves are done
    saves.put(n)  # type: ignore[attr-defined]


def save_steps_on_a_memory_root(root: str, backend: str, seconds: float, saves: object) -> None:
    """Saves steps 0, 1, 2, ... (each tensor saying its step) into a ``Checkpointer(root,
    keep=1)`` for `seconds`: on a memory root every save retires the previous step and
    overwrites the files of the one before; puts the count of saves in `saves`."""
    config = fp.Config(backend=backend, chunk_bytes=64 << 10, pool_bytes=1 << 20, queue_depth=4)
    ck = fp.Checkpointer(root, keep=1, config=config)
    n, stop = 0, time.monotonic() + seconds
    while time.monotonic() < stop:
        ck.save(n, stepped_state(n))
        ck.wait()
        n += 1
    ck.close()
    saves.put(n)  # type: ignore[attr-defined]
