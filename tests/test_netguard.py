"""The guard of tests/helpers/netguard.py: a test that reaches beyond this machine, or an object store it
did not name, is caught (the trap, the socket guard); and fastpersist's switch that forbids the
instance metadata lookup for credentials."""

from __future__ import annotations

import socket
from typing import Any

import pytest

import fastpersist as fp
from fastpersist.levels.remote_stores import METADATA_ENV, check_credentials

import netguard


def test_a_python_socket_to_a_non_loopback_address_is_refused_and_recorded() -> None:
    with pytest.raises(ConnectionRefusedError, match="not a loopback address"):
        socket.create_connection(("192.0.2.1", 9), timeout=1)  # TEST-NET-1: never routed anywhere
    found = netguard.take()
    assert len(found) == 1 and "192.0.2.1" in found[0], found


def test_an_s3_url_without_the_fixture_reaches_only_the_trap() -> None:
    """No endpoint and no credentials set by the test: the client goes where the environment
    says, the loopback trap (for its credentials too), never AWS or 169.254.169.254."""
    with pytest.raises(Exception):  # noqa: B017 (obstore's own error classes)
        fp.load("s3://bucket/run/step-00000001")
    found = netguard.take()
    assert found and all("reached the trap" in f for f in found), found


def test_the_metadata_lookup_can_be_turned_off(monkeypatch: Any) -> None:
    monkeypatch.setenv(METADATA_ENV, "off")
    with pytest.raises(ValueError, match="AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        fp.load("s3://bucket/run/step-00000001")
    assert netguard.take() == []  # refused before any request
    check_credentials("s3://b/p", {METADATA_ENV: "off", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"})
    check_credentials("s3://b/p", {METADATA_ENV: "off", "AWS_SKIP_SIGNATURE": "true"})
    check_credentials("s3://b/p", {})  # not off: the client's own order, metadata service last
