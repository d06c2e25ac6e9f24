"""Knowing at once that a peer rank is gone: one plain TCP connection to every other rank of a
control group, watched by a thread.

gloo notices a dead peer only when an operation of its own reads or writes the connection to
it: a rank waiting for bytes that a live rank will never send (that rank blocked on the dead
one, or gone from the collective after an error) waits for the whole ``timeout_s``, and so may
every survivor. So each rank of a control group also keeps one TCP connection to each other
rank, which carries nothing: the kernel closes a killed process's sockets, and a rank that leaves
a failed collective closes its own (:meth:`PeerWatch.close`). Either way its peers' watch threads
see end-of-file at once, and their waits (:meth:`fastpersist.distributed.control.ControlGroup.wait`)
raise instead of waiting for ``timeout_s``.

Rank ``i`` connects to every lower rank and accepts a connection from every higher one; each
connection starts with the group's token (drawn by rank 0) and the connecting rank, so a stray
connection is refused. A rank is reached on the loopback address when it is on the same host,
else on the address of its host that routes to ``MASTER_ADDR`` (or its host name's), or on
``$FASTPERSIST_WATCH_ADDR`` where set.

Example:
    >>> _handshake(b"0123456789abcdef", 3)[-4:]
    b'\\x00\\x00\\x00\\x03'
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

__all__ = ["ADDR_ENV", "Address", "PeerWatch"]

log = logging.getLogger("fastpersist")

#: Overrides the address this rank's peers on other hosts connect to.
ADDR_ENV = "FASTPERSIST_WATCH_ADDR"
_TOKEN_BYTES = 16
_HANDSHAKE = struct.Struct(f">{_TOKEN_BYTES}sI")


@dataclass(frozen=True)
class Address:
    """Where one rank's watch listens: its host name, the address peers on other hosts use, the port."""

    host: str
    addr: str
    port: int
    token: bytes


def _handshake(token: bytes, rank: int) -> bytes:
    return _HANDSHAKE.pack(token, rank)


def _routable_addr() -> str:
    """This host's address as other hosts reach it (see the module docstring)."""
    if os.environ.get(ADDR_ENV):
        return os.environ[ADDR_ENV]
    master = os.environ.get("MASTER_ADDR")
    if master:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, 9))  # a UDP "connect" sends nothing: it only picks the route
            return str(probe.getsockname()[0])
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = sock.recv(n - len(data))
        if not more:
            raise ConnectionError("closed during the handshake")
        data += more
    return data


class PeerWatch:
    """This rank's connections to its peers and the thread that watches them."""

    def __init__(self, rank: int, size: int, exchange: Callable[[Address], list[Address]], timeout_s: float) -> None:
        self.rank, self.size = rank, size
        self._gone: dict[int, float] = {}
        self._lock = threading.Lock()
        self._socks: dict[int, socket.socket] = {}
        self._closed = False
        listener = socket.create_server(("", 0), family=socket.AF_INET, backlog=max(size, 1))
        try:
            me = Address(
                socket.gethostname(), _routable_addr(), listener.getsockname()[1], secrets.token_bytes(_TOKEN_BYTES)
            )
            peers = exchange(me)
            token = peers[0].token
            deadline = time.monotonic() + timeout_s
            accepting = threading.Thread(
                target=self._accept, args=(listener, token, deadline), name="fastpersist-watch-accept", daemon=True
            )
            accepting.start()
            for peer in range(rank):
                self._socks[peer] = self._connect(peers[peer], token, deadline)
            accepting.join(max(deadline - time.monotonic(), 0.0))
        finally:
            listener.close()
        missing = sorted(set(range(size)) - {rank} - set(self._socks))
        if missing:
            self.close()
            raise TimeoutError(f"rank {rank}: ranks {missing} did not open their watch connection within {timeout_s} s")
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._watch, name="fastpersist-watch", daemon=True)
        self._thread.start()

    def _connect(self, peer: Address, token: bytes, deadline: float) -> socket.socket:
        addr = "127.0.0.1" if peer.host == socket.gethostname() else peer.addr
        while True:
            try:
                sock = socket.create_connection((addr, peer.port), timeout=max(deadline - time.monotonic(), 0.1))
                sock.sendall(_handshake(token, self.rank))
                sock.settimeout(None)
                return sock
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _accept(self, listener: socket.socket, token: bytes, deadline: float) -> None:
        expected = set(range(self.rank + 1, self.size))
        while expected and time.monotonic() < deadline:
            listener.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            try:
                sock.settimeout(max(deadline - time.monotonic(), 0.01))
                got, peer = _HANDSHAKE.unpack(_recv_exactly(sock, _HANDSHAKE.size))
                sock.settimeout(None)
            except (OSError, struct.error):
                sock.close()
                continue
            if got != token or peer not in expected:
                sock.close()  # not a rank of this group
                continue
            expected.discard(peer)
            with self._lock:
                self._socks[peer] = sock

    def _watch(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, -1)
        with self._lock:
            for peer, sock in self._socks.items():
                sel.register(sock, selectors.EVENT_READ, peer)
        while True:
            for key, _ in sel.select():
                peer = key.data
                if peer == -1:
                    sel.close()
                    return
                sock = cast(socket.socket, key.fileobj)
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                if data:
                    continue  # nothing is ever sent: ignore it
                sel.unregister(sock)
                with self._lock:
                    self._gone.setdefault(peer, time.monotonic())
                log.debug("rank %d: rank %d closed its watch connection", self.rank, peer)

    def gone(self) -> dict[int, float]:
        """The ranks whose connection closed (died, or left a failed collective), with when it closed."""
        with self._lock:
            return dict(self._gone)

    def close(self) -> None:
        """Closes every connection (the peers see this rank leave) and stops the thread (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        wake = getattr(self, "_wake_w", None)
        if wake is not None:  # the thread stops selecting before the sockets it watches are closed
            with contextlib.suppress(OSError):
                wake.send(b"x")
            self._thread.join(5)
            wake.close()
            self._wake_r.close()
        with self._lock:
            socks, self._socks = list(self._socks.values()), {}
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
