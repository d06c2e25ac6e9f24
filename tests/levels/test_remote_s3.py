"""The remote level on a real S3-compatible server (moto's, on 127.0.0.1, through obstore):
drain, restore when the local root is gone, a damaged object, the server gone mid-drain and
back, fp.load/inspect/verify of an s3:// URL, 4 gloo ranks as 2 nodes losing every node, and a
restore while the store is down or never answers."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import threading
import time
from typing import Any

import pytest
import torch

import fastpersist as fp
from fastpersist.levels import remote_stores

import levels_workers as w
from gloo import run_ranks
from s3server import S3Server

CONFIG = fp.Config(chunk_bytes=64 << 10, pool_bytes=1 << 20, queue_depth=4)


def state(step: int, n: int = 50_000) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=gen), "step": step}


def test_drain_to_s3_and_restore_when_the_local_root_is_gone(tmp_path: Any, s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/run1"
    with fp.Checkpointer(tmp_path / "local", keep=2, config=CONFIG, levels=[fp.Remote(url, every=2)]) as ck:
        for step in range(1, 6):
            ck.save(step, state(step))
            ck.wait_staged()
    drained = ck.levels()["remote"]["steps"]
    assert drained[-1] == 4 and len(drained) <= 2, drained  # 2 may be superseded by 4 while 1 drains
    assert fp.verify(f"{url}/step-00000004")["chunks"] >= 3
    assert fp.inspect(f"{url}/step-00000004")["tensors"] == 1
    assert torch.equal(fp.load(f"{url}/step-00000004")["w"], state(4)["w"])
    shutil.rmtree(tmp_path / "local")
    again = fp.Checkpointer(tmp_path / "local", config=CONFIG, levels=[fp.Remote(url)])
    assert again.latest() == 4
    assert torch.equal(again.load()["w"], state(4)["w"])
    assert again.steps() == [4]  # the local level was refilled


def test_a_damaged_object_is_detected_and_the_previous_remote_step_used(
    tmp_path: Any, s3_bucket: str, s3_server: S3Server
) -> None:
    url = f"s3://{s3_bucket}/run2"
    with fp.Checkpointer(tmp_path / "local", keep=3, config=CONFIG, levels=[fp.Remote(url, every=1, keep=3)]) as ck:
        for step in (1, 2):
            ck.save(step, state(step))
            ck.close()
    client = s3_server.client()
    key = next(
        o["Key"]
        for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="run2/step-00000002/")["Contents"]
        if o["Key"].endswith(".bin")
    )
    body = bytearray(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[100] ^= 0xFF
    client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
    with pytest.raises(fp.ChecksumMismatchError):
        fp.verify(f"{url}/step-00000002")
    shutil.rmtree(tmp_path / "local")
    again = fp.Checkpointer(tmp_path / "local", config=CONFIG, levels=[fp.Remote(url)])
    assert again.latest() == 1
    assert torch.equal(again.load()["w"], state(1)["w"])


def test_the_server_gone_mid_drain_and_back(tmp_path: Any, s3_bucket: str, s3_server: S3Server) -> None:
    url = f"s3://{s3_bucket}/run3"
    ck = fp.Checkpointer(tmp_path / "local", config=CONFIG, levels=[fp.Remote(url, every=1, bytes_per_s=400_000)])
    ck.save(1, state(1))
    ck.close()
    ck.save(2, state(2, 250_000))  # 1 MB at 400 KB/s: the drain runs ~2.5 s
    time.sleep(0.5)
    s3_server.proxy.stop()  # every connection dropped, nothing listening
    timer = threading.Timer(1.5, s3_server.proxy.start)
    timer.start()
    try:
        assert fp.Checkpointer(tmp_path / "other", config=CONFIG).latest() is None
        ck.close()  # the drain retried (the client's retries, then ours) and completed
    finally:
        timer.join()
    assert ck.levels()["remote"]["steps"] == [1, 2]
    assert torch.equal(fp.load(f"{url}/step-00000001")["w"], state(1)["w"])
    assert torch.equal(fp.load(f"{url}/step-00000002")["w"], state(2, 250_000)["w"])


def test_a_group_that_loses_every_node_restores_from_s3(tmp_path: Any, s3_bucket: str) -> None:
    d = str(tmp_path)
    remote = f"s3://{s3_bucket}/group"
    results = run_ranks(w.save_with_remote, 4, (d, [1, 2, 3, 4], remote), d, timeout_s=180)
    assert all("traceback" not in r for r in results), results
    # Rank 0 retires old remote steps after the commit the others wait for: they may list one more.
    assert all(r["remote"][-1] == 4 for r in results), results
    shutil.rmtree(os.path.join(d, "node0"))
    shutil.rmtree(os.path.join(d, "node1"))
    for name in os.listdir(d):
        if name.startswith(("result-", "error-", "init-store")):
            os.remove(os.path.join(d, name))
    results = run_ranks(w.restore_with_remote, 4, (d, remote), d, timeout_s=180)
    assert all(r == {"latest": 4, "step": 4, "same": True, "local": [4, 5]} for r in results), results


def _flip_a_byte(step_dir: Any) -> None:
    data = next(p for p in os.listdir(step_dir) if p.endswith(".bin"))
    with open(os.path.join(step_dir, data), "r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 1]))


def test_an_unreachable_store_never_stops_a_restore_from_the_local_level(
    tmp_path: Any, s3_bucket: str, s3_server: S3Server, caplog: Any
) -> None:
    """Repro 27: with the store down, the local level's step is restored: without asking the
    store while the local level holds the step its index names; else within the probe's bound,
    with one WARNING, the newest local step that verifies."""
    url = f"s3://{s3_bucket}/down"
    with fp.Checkpointer(tmp_path / "local", config=CONFIG, levels=[fp.Remote(url, every=1)]) as ck:
        for step in (1, 2):
            ck.save(step, state(step))
            ck.close()
    s3_server.proxy.stop()  # nothing listens: every request is refused
    try:
        again = fp.Checkpointer(tmp_path / "local", config=CONFIG, levels=[fp.Remote(url)])
        started = time.monotonic()
        assert again.latest() == 2 and torch.equal(again.load()["w"], state(2)["w"])
        assert time.monotonic() - started < 2.0
        _flip_a_byte(tmp_path / "local" / "step-00000002")  # the remote would now be worth asking
        with caplog.at_level(logging.WARNING, logger="fastpersist"):
            started = time.monotonic()
            assert again.latest() == 1
            assert torch.equal(again.load()["w"], state(1)["w"])
            took = time.monotonic() - started
        assert took < 3 * remote_stores.PROBE_TIMEOUT_S, took
        said = [r.getMessage() for r in caplog.records if "did not answer" in r.getMessage()]
        assert len(said) == 1 and url in said[0], said
    finally:
        s3_server.proxy.start()


def test_a_store_that_never_answers_costs_a_restore_a_bounded_time(
    tmp_path: Any, s3_server: S3Server, monkeypatch: Any, caplog: Any
) -> None:
    """Repro 27 ("blackhole"): a store that accepts connections and never answers blocked
    latest() for obstore's 3-minute retry budget; a restore's look at the store now gives up
    after PROBE_TIMEOUT_S (1 s here) per request and restores the local step."""
    hole = socket.create_server(("127.0.0.1", 0))  # the backlog accepts; nothing ever reads
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{hole.getsockname()[1]}")
    monkeypatch.setattr(remote_stores, "PROBE_TIMEOUT_S", 1.0)
    try:
        with fp.Checkpointer(tmp_path / "local", config=CONFIG) as ck:
            for step in (1, 2):
                ck.save(step, state(step))
        _flip_a_byte(tmp_path / "local" / "step-00000002")
        again = fp.Checkpointer(tmp_path / "local", config=CONFIG, levels=[fp.Remote("s3://bucket/never")])
        with caplog.at_level(logging.WARNING, logger="fastpersist"):
            started = time.monotonic()
            assert again.latest() == 1
            took = time.monotonic() - started
        assert took < 5.0, took
        assert any("did not answer" in r.getMessage() for r in caplog.records)
    finally:
        hole.close()


def test_incremental_steps_send_only_their_own_bytes_to_s3_and_restore_whole(tmp_path: Any, s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/incremental"
    frozen = torch.arange(256 << 10, dtype=torch.float32)  # 1 MiB that never changes
    inc = fp.Incremental(block_bytes=64 << 10)
    remote = [fp.Remote(url, every=1, keep=3)]
    with fp.Checkpointer(tmp_path / "local", keep=2, config=CONFIG, incremental=inc, levels=remote) as ck:
        for step in (1, 2, 3):
            ck.save(step, {**state(step), "frozen": frozen})
            ck.close()  # each drained before the next
    assert ck.levels()["remote"]["steps"] == [1, 2, 3]
    store = remote_stores.open_store(url)
    sent = [json.loads(store.get_bytes(f"step-{s:08d}/.fpdrained-00000.json") or b"{}")["bytes"] for s in (1, 2, 3)]
    assert sent[0] > frozen.nbytes and max(sent[1:]) < frozen.nbytes // 2, sent  # the frozen MiB went once
    shutil.rmtree(tmp_path / "local")
    again = fp.Checkpointer(tmp_path / "local", config=CONFIG, levels=[fp.Remote(url)])
    loaded = again.load()
    assert torch.equal(loaded["w"], state(3)["w"]) and torch.equal(loaded["frozen"], frozen)
    assert fp.verify(f"{url}/step-00000003")["bytes"] > frozen.nbytes
