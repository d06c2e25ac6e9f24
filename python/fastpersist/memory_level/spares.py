"""Spare files for a memory root's next save, made while the training step runs.

A memory root's steady saves overwrite a retired step's recycled files (:mod:`.recycle`), but
until a step retires (a run's first ``keep`` saves, and the first after a restart) each save
would allocate a whole step's worth of fresh tmpfs pages and populate a new mapping of them:
about 0.4 s and 0.4 s per GiB on the VMs we measure, more than the copy itself. So once a step
commits on a memory root whose recycle directory holds nothing, :func:`make_spare` starts a
thread that makes files of the same names and sizes (``_core.MemoryFileAhead``: pages
allocated, mapping populated and kept for the save, a slice at a time) in the recycle
directory, where the next save takes them as it would a retired step's.

* **Out of the way**: the thread runs at the lowest priority (nice 19), in slices of
  :data:`SLICE_BYTES`, and stops at the next slice once any save of this process starts
  (:func:`stop_spares`); one thread per process, and one per root across processes (an
  exclusive ``flock`` of the recycle directory, tried without waiting).
* **Never taken while being made**: a spare is made under a dot-name that a save never takes,
  and renamed to its entry once every file is ready. A save that starts first waits up to
  :data:`PROMPT_S` for the thread to finish its slice and hand over the files whose pages are
  all allocated (a file only partly allocated is deleted: a save writes a new file faster than
  it completes one through a mapping); a thread later than that deletes its work, so the save
  never races it.
* **Bounded**: a spare is made only while the recycle directory is empty, and it is one entry
  like a retired step's, so a root holds at most ``keep`` committed steps plus one set of
  files, as before; the next recycling frees an entry nobody took.
* **Safe as recycling is**: the spare holds no manifest and lies in the recycle directory,
  garbage by construction (``fastpersist clean`` removes it); nothing in it is reached through
  a link.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import shutil
import threading
import time

import fastpersist._core as _core

from ..format.layout import MANIFEST_NAME, RECYCLE_DIR
from .recycle import is_memory_root, open_dir_nofollow, recyclable_files, recycle_dir

__all__ = ["PROMPT_S", "SLICE_BYTES", "make_spare", "stop_spares", "wait_spare"]

log = logging.getLogger("fastpersist")

#: Work done between two looks at the stop flag: about 3 ms of allocation or page-table work.
SLICE_BYTES = 8 << 20
#: How long a starting save waits for the spare being made to be handed over.
PROMPT_S = 0.02


class _Maker:
    """One spare being made: its thread, the flag that stops it, and whether handing over
    what it made is still in time (False once a starting save stopped waiting)."""

    def __init__(self, root: str, step_path: str) -> None:
        self.stop = threading.Event()
        self.handover = threading.Lock()
        self.late = False
        self.thread = threading.Thread(
            target=_make, args=(self, root, step_path), name="fastpersist-spare", daemon=True
        )


_lock = threading.Lock()
_running: _Maker | None = None
_serial = itertools.count()


def make_spare(root: str, step_path: str) -> threading.Thread | None:
    """Starts making a spare of the committed step `step_path`'s data files in the memory root
    `root`'s recycle directory, for its next save; returns the thread, or None when there is
    nothing to do (not a memory root, files wait there already, or a spare is being made)."""
    global _running
    if not is_memory_root(root):
        return None
    with recycle_dir(root) as bin_fd:
        if bin_fd is not None and _holds_files(bin_fd):
            return None  # a retired step's files serve the next save (every commit once steady)
    with _lock:
        if _running is not None and _running.thread.is_alive():
            return None
        _running = _Maker(root, step_path)
        _running.thread.start()
        return _running.thread


def stop_spares() -> None:
    """Stops the spare being made, if any (a save is starting): waits up to :data:`PROMPT_S` for
    it to hand over what it made; after that, it deletes its work instead."""
    with _lock:
        maker = _running
    if maker is None or not maker.thread.is_alive():
        return
    maker.stop.set()
    maker.thread.join(PROMPT_S)
    with maker.handover:
        maker.late = True


def wait_spare(timeout: float | None = None) -> None:
    """Waits for the spare being made, if any, to be made or given up (tests, benchmarks)."""
    with _lock:
        maker = _running
    if maker is not None:
        maker.thread.join(timeout)


def _make(maker: _Maker, root: str, step_path: str) -> None:
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only
    started = time.perf_counter()
    try:
        made = _make_in(maker, root, step_path)
    except OSError as e:  # a full tmpfs, a root removed meanwhile: the save allocates as before
        log.debug("no spare of %s made for %s's next save: %s", step_path, root, e)
        return
    if made:
        log.debug(
            "handed a spare of %s (%d bytes, %s) to %s's next save after %.3f s",
            os.path.basename(step_path),
            made,
            "partly made: a save started" if maker.stop.is_set() else "made whole",
            root,
            time.perf_counter() - started,
        )


def _make_in(maker: _Maker, root: str, step_path: str) -> int:
    """Makes the spare; returns the bytes handed over (0 if none)."""
    with recycle_dir(root, create=True) as bin_fd:
        if bin_fd is None or not _lock_root(bin_fd, maker.stop):
            return 0
        if _holds_files(bin_fd):
            return 0  # another process's spare (or a step retired since the look) waits already
        files = recyclable_files(step_path)
        if not files:
            return 0
        wanted = [
            (os.path.relpath(f, step_path), os.lstat(f).st_size) for f in files if os.path.basename(f) != MANIFEST_NAME
        ]
        making = f".making-{os.getpid()}-{next(_serial)}"
        os.mkdir(making, dir_fd=bin_fd)
        try:
            made = _make_files(bin_fd, os.path.join(root, RECYCLE_DIR), making, wanted, maker.stop)
            with maker.handover:
                if made and not maker.late:
                    os.rename(making, f"spare-{os.path.basename(step_path)}", src_dir_fd=bin_fd, dst_dir_fd=bin_fd)
                    return made
        finally:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(making, dir_fd=bin_fd)  # too late for the save that stopped it
    return 0


def _holds_files(bin_fd: int) -> bool:
    """Whether an entry of the recycle directory open at `bin_fd` holds a file (a save that took
    an entry's files leaves its directories; a dot-name is a spare still being made)."""
    for top, dirs, names, _ in os.fwalk(".", dir_fd=bin_fd):
        if top == ".":
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            names = [n for n in names if not n.startswith(".")]
        if names:
            return True
    return False


def _lock_root(bin_fd: int, stop: threading.Event) -> bool:
    """Takes the recycle directory's exclusive flock (released when `bin_fd` closes), waiting
    while another process makes a spare there; False if stopped first."""
    while not stop.is_set():
        try:
            fcntl.flock(bin_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            stop.wait(0.05)
    return False


def _make_files(bin_fd: int, bin_path: str, making: str, wanted: list[tuple[str, int]], stop: threading.Event) -> int:
    """Makes each ``(relative path, size)`` of `wanted` under `making` in the recycle directory
    (open at `bin_fd`, at `bin_path`) until `stop` is set; the bytes of the files whose pages are
    all allocated (the one being made when stopped is deleted otherwise)."""
    made = 0
    for rel, size in wanted:
        if stop.is_set():
            break
        *dirs, name = [making, *rel.split(os.sep)]
        fds: list[int] = []
        try:
            where = bin_fd
            for d in dirs:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(d, dir_fd=where)
                fd = open_dir_nofollow(d, dir_fd=where)
                if fd is None:
                    return 0
                fds.append(fd)
                where = fd
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            file_fd = os.open(name, flags, 0o644, dir_fd=where)
            try:
                ahead = _core.MemoryFileAhead(file_fd, size, os.path.join(bin_path, *dirs, name))
            finally:
                os.close(file_fd)
            while not stop.is_set() and not ahead.advance(SLICE_BYTES):
                pass
            if ahead.allocated_bytes < size:
                # Stopped before its pages were all allocated: the save writes a new file faster.
                os.unlink(name, dir_fd=where)
                break
            made += size
        finally:
            for fd in fds:
                os.close(fd)
    return made
