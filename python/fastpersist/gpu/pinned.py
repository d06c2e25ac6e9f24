"""Host memory registered with CUDA (``cudaHostRegister``): the save arenas and the load ring's
buffers, so that copies from and to them run at pinned speed.

Three rules. A registration ends before its memory is freed: CUDA keeps the pages pinned by
address and would go on copying into the old pages after the address is reused, so each one is
tied to the object that owns the memory (an arena or a pool: undone in its own drop, before its
memory is freed; the load ring: undone when it drops a buffer). A failed registration is not an
error: ``cudaHostRegister`` reports by return code and never raises, so the code is checked,
the CUDA runtime's last error is cleared (left set, it would surface in the caller's next kernel
launch check as an unrelated error), one WARNING names the cause, and the copies run from
pageable memory. And nothing calls CUDA once the interpreter has begun to exit (the context
goes with the process).

Example:
    >>> import torch
    >>> is_pinned(torch.zeros(8, dtype=torch.uint8))
    False
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

import fastpersist._core as _core

__all__ = ["CudaRuntime", "HostRuntime", "is_pinned", "pin_host", "pinned_bytes", "unpin_host", "use_runtime"]

log = logging.getLogger("fastpersist")

#: cudaErrorHostMemoryAlreadyRegistered: someone else pinned the range; it is pinned all the same.
ALREADY_REGISTERED = 712
#: cudaHostRegisterPortable: pinned for every device's context, not only the current one (one
#: load ring serves loads to any device).
REGISTER_PORTABLE = 1


class HostRuntime(Protocol):
    """The CUDA runtime calls that pinning makes (a fake stands in for it in tests)."""

    def register(self, address: int, nbytes: int) -> int:
        """``cudaHostRegister``'s error code (0: pinned); the runtime's last error is cleared."""

    def unregister(self, address: int) -> int:
        """``cudaHostUnregister``'s error code; the runtime's last error is cleared."""

    def describe(self, code: int) -> str:
        """The text of a CUDA error code."""


@functools.cache
def _libcudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch has loaded (never a second copy), or None."""
    major = (torch.version.cuda or "").split(".")[0]
    if not major:
        return None
    try:
        return ctypes.CDLL(f"libcudart.so.{major}", mode=os.RTLD_NOLOAD)
    except OSError:
        log.debug("libcudart.so.%s is not loaded (a static runtime?): CUDA errors cannot be cleared", major)
        return None


class CudaRuntime:
    """:class:`HostRuntime` over ``torch.cuda.cudart()``, clearing the runtime's last error
    through the library torch loaded (``cudaGetLastError``; torch does not expose it). A
    registration is undone with the device current that made it: any CUDA call creates a
    context on the current device, and the thread that drops the owner may have another."""

    def __init__(self) -> None:
        self.cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        self.devices: dict[int, int] = {}  # address -> the device current at its registration

    def register(self, address: int, nbytes: int) -> int:
        code = int(self.cudart.cudaHostRegister(address, nbytes, REGISTER_PORTABLE))
        if code:
            self.clear_error()
        else:
            self.devices[address] = torch.cuda.current_device()
        return code

    def unregister(self, address: int) -> int:
        device = self.devices.pop(address, None)
        with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
            code = int(self.cudart.cudaHostUnregister(address))
            if code:
                self.clear_error()
        return code

    def describe(self, code: int) -> str:
        try:
            return f"{self.cudart.cudaGetErrorString(self.cudart.cudaError(code))} (CUDA error {code})"
        except Exception:
            return f"CUDA error {code}"

    @staticmethod
    def clear_error() -> None:
        library = _libcudart()
        if library is not None:
            library.cudaGetLastError()


_runtime: HostRuntime | None = None


def _the_runtime() -> HostRuntime:
    global _runtime
    if _runtime is None:
        _runtime = CudaRuntime()
    return _runtime


def use_runtime(runtime: HostRuntime | None) -> HostRuntime | None:
    """Installs `runtime` for the pinning calls (None: the CUDA runtime); returns the previous
    one. The seam the CPU tests drive pinning through."""
    global _runtime
    previous, _runtime = _runtime, runtime
    return previous


class _Registration(NamedTuple):
    nbytes: int
    owner: int  # id() of the object whose memory it is
    pinned: bool  # registered, by us or by someone else before us
    ours: bool  # registered by us: to be unregistered
    runtime: HostRuntime  # the runtime that registered it, and will unregister it


#: Host buffers registered (or tried) by address; and, per owner, the addresses it holds.
_registered: dict[int, _Registration] = {}
_by_owner: dict[int, list[int]] = {}
_lock = threading.RLock()  # a collection under it may drop an owner, whose callback takes it
_warned = False
_exiting = False


@atexit.register
def _stop_at_exit() -> None:
    """From here on the interpreter is exiting: no more CUDA calls (the context goes too)."""
    global _exiting
    _exiting = True


def _when_freed(owner: object, callback: Callable[[], None]) -> None:
    """Calls `callback` when `owner` goes, before its memory is freed; never during exit."""
    if isinstance(owner, (_core.Pool, _core.Arena)):
        # A weakref callback would run only after the owner's memory is freed (the Rust value
        # is dropped before weak references are cleared): the owner calls it first.
        owner.call_before_free(callback)
    else:
        weakref.finalize(owner, callback).atexit = False


def pinned_bytes() -> int:
    """Bytes of host memory this process has registered with CUDA (and not yet unregistered)."""
    with _lock:
        return sum(r.nbytes for r in _registered.values() if r.ours)


def is_pinned(host: torch.Tensor) -> bool:
    """Whether the buffer `host` starts at is registered with CUDA for its whole length."""
    with _lock:
        found = _registered.get(host.data_ptr())
    return found is not None and found.nbytes >= host.numel() and found.pinned


def pin_host(host: torch.Tensor, owner: object) -> bool:
    """Registers the CPU buffer `host` (1-D uint8, memory that `owner` keeps alive) with CUDA
    once; returns whether it is pinned. A failure only means slower copies (one WARNING), and
    is not retried while `owner` lives. The registration is undone when `owner` goes (a
    ``_core.Arena`` or ``_core.Pool``, or an object that supports weak references), before its
    memory is freed."""
    address, nbytes = host.data_ptr(), host.numel()
    if nbytes == 0:
        return True  # no page to pin, and CUDA refuses an empty range (cudaErrorInvalidValue)
    with _lock:
        found = _registered.get(address)
        if found is not None and found.nbytes == nbytes:
            return found.pinned
        if _exiting or sys.is_finalizing():
            return False
        runtime = _the_runtime()
        code = runtime.register(address, nbytes)
        pinned = code in (0, ALREADY_REGISTERED)
        _registered[address] = _Registration(nbytes, id(owner), pinned, code == 0, runtime)
        addresses = _by_owner.get(id(owner))
        if addresses is None:
            addresses = _by_owner[id(owner)] = []
            _when_freed(owner, functools.partial(_unpin_owner, id(owner)))
        addresses.append(address)
    if not pinned:
        _warn_once(nbytes, runtime.describe(code))
    return pinned


def _warn_once(nbytes: int, cause: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning(
            "cudaHostRegister of a %d-byte staging buffer failed: %s. Device copies to and from "
            "such buffers run from pageable memory (slower, and not overlapped). Likely causes: "
            "the locked-memory limit (ulimit -l), or a container or driver without host "
            "registration; checkpoints stay correct.",
            nbytes,
            cause,
        )


def _unpin_owner(owner_id: int) -> None:
    with _lock:
        addresses = _by_owner.pop(owner_id, [])
        gone = [_registered.pop(address) for address in addresses]
    if _exiting or sys.is_finalizing():
        return
    for address, registration in zip(addresses, gone, strict=True):
        if registration.ours:
            registration.runtime.unregister(address)


def unpin_host(host: torch.Tensor) -> None:
    """Undoes :func:`pin_host` before `host`'s memory is freed (a no-op if it was not pinned)."""
    address = host.data_ptr()
    with _lock:
        found = _registered.get(address)
        if found is None or found.nbytes != host.numel():
            return
        del _registered[address]
        addresses = _by_owner.get(found.owner, [])
        if address in addresses:
            addresses.remove(address)
    if found.ours and not (_exiting or sys.is_finalizing()):
        found.runtime.unregister(address)
