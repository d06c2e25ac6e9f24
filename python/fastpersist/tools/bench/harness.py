"""`Bench`: the state, the buffers and the methods of one ``fastpersist bench`` run, and the loop
that times them, repetition after repetition with the methods interleaved (A B C A B C ...).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

import fastpersist as fp
import fastpersist._core as _core

from .measure import Method, Row
from .state import build_state, count_tensors, gpt_shape, safetensors_view, state_summary
from .system import (
    GB,
    Backend,
    drop_caches,
    evict_files,
    progress,
    release_memory,
    remove_path,
    reset_peak_rss,
    status_bytes,
)


class Bench:
    """Holds the state, the buffers and every method of one ``fastpersist bench`` run."""

    # Set by add_save_methods (the engine-limit source buffer and its files, which the read-limit
    # load reads back; fio_raw only when fio runs) and by add_load_methods (weights_only), which
    # the caller runs right after construction.
    raw_buffer: np.ndarray
    raw_plan: _core.Plan
    raw_paths: list[str]
    fio_raw: list[dict[str, Any]]
    weights_only: bool

    def __init__(
        self,
        args: argparse.Namespace,
        run_dirs: list[str],
        notes: list[str],
        say: Callable[[str], None] = progress,
    ) -> None:
        import torch

        self.say = say  # where progress messages go
        self.args = args
        self.dirs = run_dirs
        self.notes = notes
        self.rows: dict[str, Row] = {}
        self.save_methods: list[Method] = []
        self.load_methods: list[Method] = []
        self.loaded_tensors: dict[str, int] = {}
        #: SaveResult.phases of each repetition of each fastpersist.save row
        self.save_phases: dict[str, list[dict[str, float]]] = {}
        #: fp.load(phases=...) of each repetition of the fastpersist.load row
        self.load_phases: dict[str, list[dict[str, float]]] = {}
        say(f"building a {args.size / 2**30:.2f} GiB training state ...")
        self.state = build_state(args.size)
        summary = state_summary(self.state)
        self.nbytes = summary["bytes"]
        self.tensor_count = summary["tensors"]
        shape = gpt_shape(args.size)
        self.shape = shape
        self.safetensors_dict, self.safetensors_meta = safetensors_view(self.state)
        gc.collect()
        backends: list[Backend] = []
        candidates: tuple[Backend, ...] = ("io_uring", "threads")
        for b in candidates:
            try:
                _core.select_backend(b)
                backends.append(b)
            except fp.BackendUnavailableError as e:
                notes.append(f"backend {b} unavailable: {e}")
        self.backends = backends
        direct_everywhere = all(_core.direct_io_supported(d) for d in run_dirs)
        self.direct: Literal["require", "auto"] = "require" if direct_everywhere else "auto"
        if self.direct != "require":
            notes.append("a --dir refuses O_DIRECT: the engine falls back to buffered I/O there")
        self.cold = drop_caches()
        if not self.cold:
            notes.append(
                "dropping the page cache is not permitted (/proc/sys/vm/drop_caches needs root): instead, "
                "this run's files are evicted with posix_fadvise(DONTNEED) before each cold step"
            )
        stripes = list(run_dirs) if len(run_dirs) > 1 else None
        self.config_kwargs: dict[str, Any] = {
            "stripes": stripes,
            "chunk_bytes": args.chunk_bytes,
            "queue_depth": args.queue_depth,
            "pool_bytes": args.pool_bytes,
        }
        self.torch = torch

    # -- rows ------------------------------------------------------------------------------------

    def add_row(self, key: str, label: str, kind: str, role: str, *, note: str = "", rate: bool = True) -> str:
        """Adds a table row (empty until its method runs); returns its key."""
        self.rows[key] = Row(key, label, kind, role, note=note, rate=rate)
        return key

    def path(self, name: str, stripe: int = 0) -> str:
        """Where a method writes `name`: in this run's directory on drive `stripe`."""
        return os.path.join(self.dirs[stripe], name)

    def loaded(self, key: str, loaded: object) -> None:
        """Records how many tensors the load behind row `key` returned."""
        self.loaded_tensors[key] = count_tensors(loaded)

    # -- running ---------------------------------------------------------------------------------

    def _record(self, times: dict[str, float], peak_rss_bytes: int) -> str:
        parts = []
        for key, seconds in times.items():
            row = self.rows[key]
            row.seconds.append(seconds)
            row.peak_rss_bytes = max(row.peak_rss_bytes, peak_rss_bytes)
            what = f"{row.label.split(': ')[-1]} " if len(times) > 1 else ""
            rate = f" ({self.nbytes / seconds / GB:.2f} GB/s)" if row.rate else ""
            parts.append(f"{what}{seconds:.3f} s{rate}")
        return ", ".join(parts) + f"; peak RSS {peak_rss_bytes / 2**30:.2f} GiB"

    def make_cold(self) -> None:
        """Empties the page cache before a timed step: drops it (sync, then /proc/sys/vm/drop_caches),
        or where that is refused evicts this run's files with posix_fadvise(DONTNEED)."""
        if self.cold:
            self.cold = drop_caches()
        if not self.cold:
            evict_files(self.dirs)

    def run_saves(self, *, cold: bool = False) -> None:
        """Times every save method `args.reps` times, interleaved; `cold` empties the page cache before each."""
        reps = self.args.reps
        for rep in range(reps):
            last = rep == reps - 1
            for method in self.save_methods:
                self.say(f"save {rep + 1}/{reps}: {method.name} ...")
                for p in method.outputs:
                    remove_path(p)
                if cold:
                    self.make_cold()
                else:
                    os.sync()
                reset_peak_rss()
                times = method.run()
                peak = status_bytes("VmHWM")
                self.say(f"save {rep + 1}/{reps}: {method.name}: {self._record(times, peak)}")
                if not (last and method.keep_last):
                    for p in method.outputs:
                        remove_path(p)
                release_memory()

    def run_loads(self) -> None:
        """Times every load method `args.reps` times, interleaved, each after :meth:`make_cold`."""
        reps = self.args.reps
        for rep in range(reps):
            for method in self.load_methods:
                self.make_cold()
                self.say(f"load {rep + 1}/{reps}: {method.name} ...")
                reset_peak_rss()
                times = method.run()
                peak = status_bytes("VmHWM")
                release_memory()  # the loaded state is gone before the next load
                self.say(f"load {rep + 1}/{reps}: {method.name}: {self._record(times, peak)}")

    def cleanup(self) -> None:
        for method in self.save_methods:
            for p in method.outputs:
                with contextlib.suppress(OSError):
                    remove_path(p)
