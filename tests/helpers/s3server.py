"""A real S3-compatible server for the tests: moto's standalone server on 127.0.0.1, reached
through a TCP proxy that a test can stop and restart (the server "going away" mid-transfer,
from the client's side, while its objects survive)."""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proxy:
    """Forwards 127.0.0.1:port to the server; :meth:`stop` drops the listener and every connection."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = _free_port()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.start()

    def start(self) -> None:
        self._stopped.clear()
        self._listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(5)

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        peers: dict[socket.socket, socket.socket] = {}
        while not self._stopped.is_set():
            for key, _ in sel.select(0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    client, _ = sock.accept()
                    upstream = socket.create_connection(("127.0.0.1", self.target))
                    peers[client], peers[upstream] = upstream, client
                    sel.register(client, selectors.EVENT_READ, None)
                    sel.register(upstream, selectors.EVENT_READ, None)
                    continue
                try:
                    data = sock.recv(1 << 16)
                except OSError:
                    data = b""
                other = peers.get(sock)
                if not data or other is None:
                    for s in (sock, other):
                        if s is not None and s in peers:
                            sel.unregister(s)
                            peers.pop(s, None)
                            s.close()
                    continue
                try:
                    other.sendall(data)
                except OSError:
                    pass
        for s in list(peers):
            s.close()
        sel.unregister(self._listener)
        self._listener.close()


class S3Server:
    """moto's server in a subprocess, behind a :class:`Proxy`."""

    def __init__(self) -> None:
        self.server_port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.server_port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.server_port}/moto-api/", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the moto S3 server did not start") from None
                time.sleep(0.1)
        self.proxy = Proxy(self.server_port)

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.proxy.port}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
        }

    def client(self) -> Any:
        """A boto3 client straight to the server (test-side only: buckets, damage)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{self.server_port}",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def close(self) -> None:
        self.proxy.stop()
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    yield server
    server.close()


@pytest.fixture
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket; the AWS environment variables point at the server (spawned ranks inherit them)."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    name = f"fp-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)
    return name


__all__ = ["S3Server", "s3_bucket", "s3_server"]
os.environ.setdefault("MOTO_ALLOW_NONEXISTENT_REGION", "true")
