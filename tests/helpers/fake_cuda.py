"""Fakes of the CUDA calls the device path makes, for its CPU tests: the host-registration
runtime (:mod:`fastpersist.gpu.pinned`), ``torch.cuda`` as the CUDA copier and loader use it,
and a copy engine whose copies land later (:class:`LaterCopier`, for ``use_copier``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

__all__ = ["FakeCuda", "FakeRuntime", "InstantCopier", "LaterCopier"]


class InstantCopier:
    """A fake copy engine over host memory whose copies are done when ``copy`` returns."""

    needs_pinned_memory = False

    def __init__(self, device: object) -> None:
        pass

    def begin(self) -> None:
        pass

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, early: bool = False) -> None:
        for src, dst in pairs:
            dst.copy_(src)

    def wait(self) -> None:
        pass


class LaterCopier:
    """A fake copy engine for ``fastpersist.gpu.use_copier``: each ``copy`` call's pairs land on
    a thread of their own after `delay_s`, as a queued DMA lands after the call returned (a job
    that read its arena before ``wait`` would see stale bytes); ``wait`` joins them. Early copies
    (``early=True``) land before ``copy`` returns, as a GPU orders them before the caller's later
    work."""

    needs_pinned_memory = False
    delay_s = 0.002

    def __init__(self, device: object) -> None:
        self.threads: list[threading.Thread] = []

    def begin(self) -> None:
        pass

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, early: bool = False) -> None:
        if early:
            for src, dst in pairs:
                dst.copy_(src)
            return

        def land() -> None:
            time.sleep(self.delay_s)
            for src, dst in pairs:
                dst.copy_(src)

        self.threads.append(threading.Thread(target=land))
        self.threads[-1].start()

    def wait(self) -> None:
        for thread in self.threads:
            thread.join()
        self.threads = []


class FakeRuntime:
    """Records registrations (with the device current at each, where `current` tells it) and
    answers `code` to each register call."""

    def __init__(self, code: int = 0, current: Callable[[], int] | None = None) -> None:
        self.code = code
        self.current = current
        self.calls: list[tuple[str, int]] = []
        self.devices: list[int] = []
        self.on_unregister: Callable[[int], None] | None = None

    def register(self, address: int, nbytes: int) -> int:
        self.calls.append(("register", address))
        if self.current is not None:
            self.devices.append(self.current())
        return self.code

    def unregister(self, address: int) -> int:
        self.calls.append(("unregister", address))
        if self.on_unregister is not None:
            self.on_unregister(address)
        return 0

    def describe(self, code: int) -> str:
        return f"fake error {code}"


class FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.recorded_on: int | None = None

    def record(self, stream: object) -> None:
        self.recorded_on = self.cuda.current
        self.cuda.calls.append(("record", self.cuda.current))

    def synchronize(self) -> None:
        self.cuda.calls.append(("event_synchronize", self.cuda.current))


class FakeStream:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda

    def wait_event(self, event: object) -> None:
        self.cuda.calls.append(("wait_event", self.cuda.current))

    def wait_stream(self, stream: object) -> None:
        self.cuda.calls.append(("wait_stream", self.cuda.current))

    def synchronize(self) -> None:
        self.cuda.calls.append(("synchronize", self.cuda.current))


class FakeCuda:
    """``torch.cuda`` over CPU memory, as far as CudaCopier and CudaLoader use it: tracks the
    current device (0 on a new thread, as CUDA's is) and records the device current at each
    call that would touch a CUDA context."""

    def __init__(self) -> None:
        self.current = 0
        self.calls: list[tuple[str, int]] = []

    @contextmanager
    def device(self, device: torch.device) -> Iterator[None]:
        previous, self.current = self.current, torch.device(device).index or 0
        try:
            yield
        finally:
            self.current = previous

    def current_device(self) -> int:
        return self.current

    @contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        self.calls.append(("stream", self.current))
        yield

    def Stream(self, device: torch.device) -> FakeStream:
        return FakeStream(self)

    def Event(self) -> FakeEvent:
        self.calls.append(("event", self.current))
        return FakeEvent(self)

    def current_stream(self, device: torch.device) -> FakeStream:
        return FakeStream(self)
