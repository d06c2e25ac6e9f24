"""No test reaches beyond this machine, and every object store a test reaches is one it named.

* The AWS variables of the developer's environment are dropped, and every process of the test
  run (spawned ranks and subprocesses inherit it) gets ``AWS_ENDPOINT_URL`` and
  ``AWS_METADATA_ENDPOINT`` pointing at a *trap*: a loopback HTTP server that answers 403 and
  records each request. A test that touches an object store sets the endpoint and credentials of
  the local server itself (the ``s3_bucket`` fixture of tests/helpers/s3server.py); one that forgets
  reaches the trap, never AWS, and never the cloud's instance metadata service (which the client
  asks for credentials when none are set: 169.254.169.254).
* Python sockets in the test process (and in ranks started by tests/helpers/gloo.py) refuse to connect
  to any address that is not loopback, and record the attempt.

The ``no_traffic_beyond_loopback`` fixture (autouse, tests/conftest.py) fails a test after which
anything was recorded; :func:`take` hands a test what was recorded (and forgets it), for tests
that make such an attempt on purpose.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import tempfile
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: Where the guards of every process of the run record what they stopped (one file each).
DIR_ENV = "FASTPERSIST_TEST_NETGUARD_DIR"

_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex


def _record(what: str) -> None:
    folder = os.environ.get(DIR_ENV)
    if folder:
        with open(os.path.join(folder, f"{os.getpid()}-{uuid.uuid4().hex}.txt"), "w") as f:
            f.write(what)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:  # a name: every address it resolves to must be loopback
        try:
            infos = socket.getaddrinfo(host, None)
        except OSError:
            return False
        return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


def _check(sock: socket.socket, address: Any) -> None:
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    host = str(address[0])
    if not _loopback(host):
        _record(f"a Python socket tried to connect to {address}")
        raise ConnectionRefusedError(
            f"tests/helpers/netguard.py: {address} is not a loopback address; tests stay local"
        )


def _guarded_connect(self: socket.socket, address: Any) -> None:
    _check(self, address)
    _real_connect(self, address)


def _guarded_connect_ex(self: socket.socket, address: Any) -> int:
    _check(self, address)
    return _real_connect_ex(self, address)


def guard_sockets() -> None:
    """Makes this process's Python sockets refuse non-loopback addresses (idempotent)."""
    socket.socket.connect = _guarded_connect  # type: ignore[method-assign]
    socket.socket.connect_ex = _guarded_connect_ex  # type: ignore[method-assign]


class _TrapHandler(BaseHTTPRequestHandler):
    def _trap(self) -> None:
        _record(f"an HTTP client reached the trap: {self.command} {self.path} (Host: {self.headers.get('Host')})")
        self.send_response(403)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _trap

    def log_message(self, format: str, *args: Any) -> None:
        pass


def install() -> str:
    """Sets up the trap, the environment and this process's socket guard; returns the trap's URL."""
    folder = tempfile.mkdtemp(prefix="fastpersist-netguard-")
    os.environ[DIR_ENV] = folder
    server = ThreadingHTTPServer(("127.0.0.1", 0), _TrapHandler)
    threading.Thread(target=server.serve_forever, name="netguard-trap", daemon=True).start()
    trap = f"http://127.0.0.1:{server.server_address[1]}"
    for key in list(os.environ):
        if key.startswith("AWS_"):
            del os.environ[key]
    os.environ.update(
        {
            "AWS_ENDPOINT_URL": trap,  # a test that names no store of its own reaches only this
            "AWS_METADATA_ENDPOINT": trap,  # where the client would ask for credentials
            "AWS_EC2_METADATA_DISABLED": "true",  # boto3's switch (the test side's client)
            "AWS_REGION": "us-east-1",
        }
    )
    guard_sockets()
    return trap


def take() -> list[str]:
    """What the guards and the trap recorded since the last call (then forgotten)."""
    folder = os.environ.get(DIR_ENV, "")
    found = []
    for name in sorted(os.listdir(folder)) if folder else []:
        path = os.path.join(folder, name)
        with open(path) as f:
            found.append(f.read())
        os.remove(path)
    return found
