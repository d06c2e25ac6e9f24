"""The tuning cache and Config "auto": round trip, stale and foreign entries, unknown devices,
an unwritable cache, the pool cap, and saves and loads that use what the cache says."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os

import pytest
import torch

import fastpersist as fp
from fastpersist import _core
from fastpersist.config import DEFAULT_CHUNK_BYTES, DEFAULT_QUEUE_DEPTH, resolve
from fastpersist.tuning.cache import CACHE_ENV, MAX_AGE_DAYS, Best, Figure, TuneEntry, cache_path, lookup, store
from fastpersist.tuning.identity import DeviceIdentity, device_identity

MiB = 1 << 20


@pytest.fixture
def cache_file(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> str:
    path = str(tmp_path_factory.mktemp("cache") / "sub" / "tune.json")
    monkeypatch.setenv(CACHE_ENV, path)
    return path


def _entry(
    identity: DeviceIdentity,
    *,
    chunk: int = 16 * MiB,
    depth: int = 4,
    read_depth: int = 16,
    age_days: float = 1.0,
) -> TuneEntry:
    when = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=age_days)
    return TuneEntry(
        device=identity.to_json(),
        tuned_at=when.isoformat(timespec="seconds"),
        write=Best(chunk, depth, 3.1),
        read=Best(chunk, read_depth, 3.4),
        figures=[Figure("write", chunk, depth, 3.1, 64 * MiB), Figure("read", chunk, read_depth, 3.4, 64 * MiB)],
        pool_bytes=256 * MiB,
        seconds=6.0,
    )


def test_cache_path_honours_the_override_then_xdg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, "/x/y.json")
    assert cache_path() == "/x/y.json"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert cache_path() == "/xdg/fastpersist/tune.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_path() == os.path.expanduser("~/.cache/fastpersist/tune.json")


def test_round_trip_keeps_every_figure(cache_file: str, workdir: str) -> None:
    identity = device_identity(workdir)
    entry = _entry(identity)
    assert store(entry) == cache_file
    assert lookup(identity) == entry
    doc = json.load(open(cache_file))
    assert doc["version"] == 1 and list(doc["devices"]) == [identity.key]
    other = dataclasses.replace(identity, key="259:7")  # a second device keeps the first one's entry
    store(_entry(other, chunk=4 * MiB))
    assert lookup(identity) == entry and lookup(other) is not None


def test_stale_entry_is_ignored_with_a_note(cache_file: str, workdir: str, caplog: pytest.LogCaptureFixture) -> None:
    identity = device_identity(workdir)
    store(_entry(identity, age_days=MAX_AGE_DAYS + 5))
    with caplog.at_level(logging.INFO, logger="fastpersist"):
        assert lookup(identity) is None
        resolved = resolve(fp.Config(), workdir, "write")
    assert "days ago" in caplog.text and "fastpersist tune" in caplog.text
    assert (resolved.config.chunk_bytes, resolved.config.queue_depth) == (DEFAULT_CHUNK_BYTES, DEFAULT_QUEUE_DEPTH)
    assert resolved.source == "default"


def test_entry_of_another_device_with_the_same_number_is_ignored(
    cache_file: str, workdir: str, caplog: pytest.LogCaptureFixture
) -> None:
    identity = device_identity(workdir)
    replaced = dataclasses.replace(identity, serial="OLD-DRIVE-0001", model="Old SSD")
    store(_entry(replaced))
    with caplog.at_level(logging.INFO, logger="fastpersist"):
        assert lookup(identity) is None
    assert "another device" in caplog.text and "OLD-DRIVE-0001" in caplog.text


def test_unknown_device_and_missing_or_broken_cache_fall_back_to_defaults(cache_file: str, workdir: str) -> None:
    identity = device_identity(workdir)
    store(_entry(dataclasses.replace(identity, key="259:99")))  # only some other device is tuned
    assert resolve(fp.Config(), workdir, "write").source == "default"
    os.remove(cache_file)
    assert resolve(fp.Config(), workdir, "read").config.queue_depth == DEFAULT_QUEUE_DEPTH
    with open(cache_file, "w") as f:
        f.write("{not json")
    resolved = resolve(fp.Config(), workdir, "write")
    assert (resolved.config.chunk_bytes, resolved.source) == (DEFAULT_CHUNK_BYTES, "default")
    with open(cache_file, "w") as f:
        json.dump({"version": 1, "devices": {identity.key: {"device": identity.to_json(), "write": "bad"}}}, f)
    assert resolve(fp.Config(), workdir, "write").source == "default"


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("chunk_bytes", 5000, "multiple of 4096"),  # the repro: every save failed blaming Config.chunk_bytes
        ("chunk_bytes", "16777216", "chunk_bytes='16777216'"),
        ("chunk_bytes", 2 << 30, "chunk_bytes=2147483648"),
        ("queue_depth", 0, "queue_depth=0"),
        ("queue_depth", 1 << 20, "queue_depth=1048576"),
        ("queue_depth", 4.5, "queue_depth=4.5"),
        ("gb_per_s", float("nan"), "gb_per_s=nan"),
        ("write", "fast", "not 'fast'"),
        ("write", None, "no 'chunk_bytes'"),
    ],
)
def test_a_malformed_entry_means_not_tuned_and_names_the_file(
    cache_file: str, workdir: str, caplog: pytest.LogCaptureFixture, field: str, value: object, named: str
) -> None:
    identity = device_identity(workdir)
    doc = _entry(identity).to_json()
    if field == "write":
        doc["write"] = value if value is not None else {"queue_depth": 4, "gb_per_s": 1.0}
    else:
        doc["write"][field] = value
    os.makedirs(os.path.dirname(cache_file), exist_ok=True)
    with open(cache_file, "w") as f:
        json.dump({"version": 1, "devices": {identity.key: doc}}, f)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        assert lookup(identity) is None
        resolved = resolve(fp.Config(), workdir, "write")
        path = os.path.join(workdir, "ckpt")
        fp.save({"w": torch.arange(1000)}, path)  # a default save and load still work
        assert torch.equal(fp.load(path)["w"], torch.arange(1000))
    assert (resolved.config.chunk_bytes, resolved.source) == (DEFAULT_CHUNK_BYTES, "default")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(cache_file in m and identity.key in m and named in m for m in warned), warned


def test_an_entry_that_is_no_object_means_not_tuned(
    cache_file: str, workdir: str, caplog: pytest.LogCaptureFixture
) -> None:
    identity = device_identity(workdir)
    os.makedirs(os.path.dirname(cache_file), exist_ok=True)
    with open(cache_file, "w") as f:
        json.dump({"version": 1, "devices": {identity.key: [1, 2]}}, f)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        assert lookup(identity) is None
    assert cache_file in caplog.text and "not list" in caplog.text


def test_auto_takes_the_cached_settings_for_a_save_and_a_load(cache_file: str, workdir: str) -> None:
    identity = device_identity(workdir)
    store(_entry(identity, chunk=16 * MiB, depth=4, read_depth=16))
    resolved = resolve(fp.Config(), os.path.join(workdir, "not-yet", "ckpt"), "write")  # a target to be made
    assert (resolved.config.chunk_bytes, resolved.config.queue_depth) == (16 * MiB, 4)
    assert resolved.source.startswith(f"tuned {datetime.date.today().isoformat()}"[:13])
    assert identity.key in resolved.source
    assert fp.Config().resolved_for(workdir, "read").queue_depth == 16
    state = {"w": torch.arange(5 * MiB, dtype=torch.uint8)}
    path = os.path.join(workdir, "ckpt")
    fp.save(state, path)
    assert fp.inspect(path)["chunk_bytes"] == 16 * MiB
    assert torch.equal(fp.load(path)["w"], state["w"])


def test_a_checkpointer_saves_with_the_tuned_chunk(cache_file: str, workdir: str) -> None:
    store(_entry(device_identity(workdir), chunk=2 * MiB))
    ck = fp.Checkpointer(os.path.join(workdir, "run"))
    ck.save(1, {"w": torch.ones(3 * MiB // 4)})
    ck.wait()
    assert fp.inspect(os.path.join(workdir, "run", "step-00000001"))["chunk_bytes"] == 2 * MiB


def test_explicit_integers_win_over_the_cache(cache_file: str, workdir: str) -> None:
    store(_entry(device_identity(workdir), chunk=16 * MiB, depth=4))
    explicit = fp.Config(chunk_bytes=1 * MiB, queue_depth=2)
    resolved = resolve(explicit, workdir, "write")
    assert resolved.config is explicit and resolved.source == "explicit"
    mixed = resolve(fp.Config(chunk_bytes=1 * MiB), workdir, "write")
    assert (mixed.config.chunk_bytes, mixed.config.queue_depth) == (1 * MiB, 4)
    assert mixed.source.startswith("chunk explicit, depth tuned ")
    path = os.path.join(workdir, "explicit")
    fp.save({"w": torch.ones(1 << 20)}, path, config=explicit)
    assert fp.inspect(path)["chunk_bytes"] == 1 * MiB


def test_the_pool_caps_a_tuned_chunk_and_depth(cache_file: str, workdir: str) -> None:
    store(_entry(device_identity(workdir), chunk=64 * MiB, depth=32, read_depth=32))
    small = resolve(fp.Config(pool_bytes=32 * MiB), workdir, "write").config
    assert (small.chunk_bytes, small.queue_depth) == (16 * MiB, 2)  # two slots of the pool, one write each
    tiny = resolve(fp.Config(pool_bytes=0), workdir, "write").config
    assert tiny.chunk_bytes == DEFAULT_CHUNK_BYTES  # never below what an untuned save uses
    roomy = resolve(fp.Config(pool_bytes=1 << 30), workdir, "write").config
    assert (roomy.chunk_bytes, roomy.queue_depth) == (64 * MiB, 16)
    assert resolve(fp.Config(pool_bytes=32 * MiB), workdir, "read").config.queue_depth == 32  # reads use no pool
    pool = _core.Pool(small.resolved_chunk_bytes, small.pool_bytes)
    assert pool.slot_count * pool.slot_bytes <= 32 * MiB


def test_a_group_keeps_the_default_chunk_and_takes_the_depth(cache_file: str, workdir: str) -> None:
    store(_entry(device_identity(workdir), chunk=16 * MiB, depth=4))
    resolved = resolve(fp.Config(), workdir, "write", tuned_chunk=False)
    assert (resolved.config.chunk_bytes, resolved.config.queue_depth) == (DEFAULT_CHUNK_BYTES, 4)
    assert "process group" in resolved.source


def test_an_unwritable_cache_never_breaks_a_save(workdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = os.path.join(workdir, "a-file")
    open(blocker, "w").close()
    monkeypatch.setenv(CACHE_ENV, os.path.join(blocker, "tune.json"))  # its folder is a file: ENOTDIR
    with pytest.raises(OSError, match=r"cannot write the tuning cache .*FASTPERSIST_TUNE_CACHE"):
        store(_entry(device_identity(workdir)))
    path = os.path.join(workdir, "ckpt")
    fp.save({"w": torch.ones(8)}, path)
    assert fp.inspect(path)["chunk_bytes"] == DEFAULT_CHUNK_BYTES


def test_auto_and_bad_values_in_config() -> None:
    assert fp.Config().chunk_bytes == "auto" and fp.Config().queue_depth == "auto"
    with pytest.raises(ValueError, match=r'chunk_bytes=.big.: expected "auto" or a positive integer'):
        fp.Config(chunk_bytes="big")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match='queue_depth=0: expected "auto" or an integer'):
        fp.Config(queue_depth=0)
    with pytest.raises(ValueError, match="resolved_for"):
        _ = fp.Config().resolved_chunk_bytes


def test_identity_reads_the_parent_disk_of_a_partition(tmp_path: pytest.TempPathFactory) -> None:
    root = str(tmp_path)
    dev = os.stat(root).st_dev
    key = f"{os.major(dev)}:{os.minor(dev)}"
    sysfs = os.path.join(root, "sys")
    disk = os.path.join(sysfs, "devices", "pci0", "nvme", "nvme0n1")
    os.makedirs(os.path.join(disk, "nvme0n1p2"))
    open(os.path.join(disk, "nvme0n1p2", "partition"), "w").close()
    os.makedirs(os.path.join(disk, "device"))
    for name, text in (("model", "Fast SSD 990\n"), ("serial", "S123\n")):
        with open(os.path.join(disk, "device", name), "w") as f:
            f.write(text)
    os.makedirs(os.path.join(sysfs, "dev", "block"))
    os.symlink(os.path.join(disk, "nvme0n1p2"), os.path.join(sysfs, "dev", "block", key))
    mountinfo = os.path.join(root, "mountinfo")
    with open(mountinfo, "w") as f:
        f.write(f"30 1 {key} / / rw,relatime shared:1 - xfs /dev/nvme0n1p2 rw\n")
    ident = device_identity(root, sysfs=sysfs, mountinfo=mountinfo)
    assert (ident.key, ident.fs_type, ident.disk, ident.model, ident.serial) == (
        key,
        "xfs",
        "nvme0n1",
        "Fast SSD 990",
        "S123",
    )
    assert ident.matches(ident.to_json())
    assert not ident.matches({**ident.to_json(), "serial": "S999"})
    assert "Fast SSD 990" in ident.describe()


def test_with_stripes_the_first_stripe_device_decides(cache_file: str, workdir: str) -> None:
    identity = device_identity(workdir)
    store(_entry(identity, chunk=16 * MiB, depth=4))
    striped = fp.Config(stripes=[workdir])
    assert resolve(striped, "/dev/shm", "write").config.chunk_bytes == 16 * MiB  # not /dev/shm's device
    assert resolve(fp.Config(stripes=["/dev/shm"]), workdir, "write").source == "default"
