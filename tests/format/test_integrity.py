"""Damage is detected, never returned as different data; load runs no code and stays confined.

The corruption campaign damages a real checkpoint (manifest and two striped data files) at
random: byte flips everywhere, zeroed pages, truncation, appended garbage, deletion. Every
damage must make both ``verify`` and ``load`` raise a fastpersist error naming the file.
Set FASTPERSIST_TEST_SEED to replay a run and FASTPERSIST_DAMAGE_FLIPS for more flips per file (or
run scripts/soak.sh); the summary line (``-s``) gives the counts.
"""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import typing
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import fastpersist as fp
from fastpersist.format.seal import seal

from budget import iterations

SEED = int(os.environ.get("FASTPERSIST_TEST_SEED", random.SystemRandom().randrange(1 << 32)))
#: Byte flips per damaged file (at most one per byte): 130 in CI, scaled by the soak profile.
FLIPS = iterations("FASTPERSIST_DAMAGE_FLIPS", 130)


def rich_state() -> dict[str, object]:
    g = torch.Generator().manual_seed(1)
    return {
        "model": {"w": torch.randn(300, 200, generator=g), "b": torch.randn(300, generator=g).bfloat16()},
        "opt": {"state": {0: {"exp_avg": torch.randn(40_000, generator=g)}}, "lr": 1e-3, "betas": (0.9, 0.99)},
        "step": 1234,
        "rng": torch.get_rng_state(),
        "names": ["alpha", "beta"],
    }


def saved(workdir: str, backend: str) -> tuple[str, fp.Config, list[str]]:
    stripes = [os.path.join(workdir, f"ssd{i}") for i in range(2)]
    for s in stripes:
        os.makedirs(s, exist_ok=True)
    cfg = fp.Config(stripes=stripes, backend=backend, chunk_bytes=64 << 10, pool_bytes=1 << 20)
    path = os.path.join(workdir, "ck")
    fp.save(rich_state(), path, config=cfg)
    files = [os.path.join(path, "manifest.json"), *(f["path"] for f in fp.inspect(path)["files"])]
    assert len(files) == 3
    return path, cfg, files


Damage = tuple[str, str, Callable[[bytearray], bytes | None]]


def damages(files: list[str], originals: dict[str, bytes], rng: random.Random) -> list[Damage]:
    """(file, description, fn(bytes) -> new bytes or None to delete)."""
    out: list[Damage] = []
    for f in files:
        size = len(originals[f])
        for pos in rng.sample(range(size), min(size, FLIPS)):
            mask = rng.randrange(1, 256)
            out.append((f, f"flip byte {pos} ^ {mask:#x}", lambda b, p=pos, m=mask: _flip(b, p, m)))
        for cut in [*rng.sample(range(size), 4), 0]:
            out.append((f, f"truncate to {cut}", lambda b, c=cut: bytes(b[:c])))
        for extra in (1, rng.randrange(2, 5000)):
            garbage = rng.randbytes(extra)
            out.append((f, f"append {extra} bytes", lambda b, g=garbage: bytes(b) + g))
        for page in rng.sample(range(-(-size // 4096)), min(4, -(-size // 4096))):
            out.append((f, f"zero page {page}", lambda b, p=page: _zero(b, p)))
        out.append((f, "delete", lambda b: None))
    return out


def _flip(b: bytearray, pos: int, mask: int) -> bytes:
    b[pos] ^= mask
    return bytes(b)


def _zero(b: bytearray, page: int) -> bytes:
    b[page * 4096 : (page + 1) * 4096] = bytes(len(b[page * 4096 : (page + 1) * 4096]))
    return bytes(b)


def _write(path: str, data: bytes | None) -> None:
    if data is None:
        os.remove(path)
        return
    with open(path, "wb") as f:
        f.write(data)


def test_every_damage_anywhere_is_detected_by_verify_and_load(workdir: str, backend: str) -> None:
    path, cfg, files = saved(workdir, backend)
    expected = rich_state()
    originals = {f: open(f, "rb").read() for f in files}
    rng = random.Random(SEED)
    detected = changed = 0
    for target, what, fn in damages(files, originals, rng):
        new = fn(bytearray(originals[target]))
        if new == originals[target]:
            continue  # e.g. a zeroed page that was already zero: nothing changed
        if target.endswith("manifest.json") and new == originals[target] + b"\n":
            continue  # the one trailing newline the format allows (docs/format.md): same bytes read
        changed += 1
        _write(target, new)
        try:
            for op in ("verify", "load"):
                try:
                    fp.verify(path) if op == "verify" else fp.load(path, config=cfg)
                except fp.FastPersistError as caught:
                    err = caught
                else:
                    pytest.fail(f"seed {SEED}: {what} in {target}: {op} raised nothing")
                context = f"seed {SEED}: {what} in {target}: {op} raised {type(err).__name__}: {err}"
                if new is None and target.endswith("manifest.json"):
                    assert isinstance(err, fp.CheckpointNotFoundError) and isinstance(err, FileNotFoundError), context
                else:
                    assert isinstance(err, fp.CorruptCheckpointError), context
                    assert os.path.basename(target) in str(err), context
                if isinstance(err, fp.ChecksumMismatchError):
                    assert err.filename == target and "bytes [" in str(err), context
            detected += 1
        finally:
            _write(target, originals[target])
    assert detected == changed > sum(min(len(b), FLIPS) for b in originals.values())  # every flip, and more
    assert_equal_state(fp.load(path, config=cfg), expected)  # restored: loads again, same values
    print(f"\ncorruption campaign ({backend}, seed {SEED}): {detected}/{changed} damages detected by verify and load")


def assert_equal_state(a: object, b: object) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_equal_state(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_equal_state(x, y)
    else:
        assert a == b


# ----------------------------------------------------------------------------- the manifest seal


def test_seal_covers_a_dict_key_and_a_value(workdir: str) -> None:
    path = os.path.join(workdir, "k")
    fp.save({"alpha": 1, "beta": torch.ones(3)}, path)
    manifest = os.path.join(path, "manifest.json")
    raw = open(manifest, "rb").read()
    for old, new in ((b'"alpha"', b'"alphb"'), (b'"1"', b'"3"')):
        assert raw.count(old) == 1
        open(manifest, "wb").write(raw.replace(old, new))
        with pytest.raises(fp.CorruptCheckpointError, match="manifest_sha256 seal"):
            fp.load(path)
    open(manifest, "wb").write(raw)
    assert fp.load(path)["alpha"] == 1


def test_the_seal_allows_one_trailing_newline_and_nothing_else(workdir: str) -> None:
    """docs/format.md: a sealed manifest may end with one newline (text tools add it); any other
    tail, a second newline included, leaves the seal unmatched and the checkpoint refused."""
    path = os.path.join(workdir, "nl")
    fp.save({"w": torch.arange(4.0), "step": 3}, path)
    manifest = os.path.join(path, "manifest.json")
    raw = open(manifest, "rb").read()
    assert raw.endswith(b'"}')  # the writer adds no newline
    open(manifest, "wb").write(raw + b"\n")
    fp.verify(path)
    assert fp.load(path)["step"] == 3
    for tail in (b"\n\n", b"\r\n", b" ", b"\x00", b"}"):
        open(manifest, "wb").write(raw + tail)
        for op in (fp.verify, fp.load):
            with pytest.raises(fp.CorruptCheckpointError, match=r"manifest\.json"):
                op(path)


def test_format_1_0_manifests_without_a_seal_still_load(workdir: str) -> None:
    path = os.path.join(workdir, "old")
    state = {"w": torch.arange(10.0), "step": 7}
    fp.save(state, path)
    manifest = os.path.join(path, "manifest.json")
    doc = json.load(open(manifest))
    assert doc["format_version"] == [1, 2] and len(doc.pop("manifest_sha256")) == 64
    doc["format_version"] = [1, 0]
    open(manifest, "w").write(json.dumps(doc, separators=(",", ":")))
    back = fp.load(path)
    assert back["step"] == 7 and torch.equal(back["w"], state["w"])
    assert fp.inspect(path)["format_version"] == "1.0"
    fp.verify(path)
    # A 1.1 manifest that lost its seal is damaged, not old.
    doc["format_version"] = [1, 1]
    open(manifest, "w").write(json.dumps(doc))
    with pytest.raises(fp.CorruptCheckpointError, match="has none"):
        fp.load(path)


def test_missing_checkpoint_or_manifest_is_a_fastpersist_file_not_found(workdir: str) -> None:
    path = os.path.join(workdir, "m")
    for missing in (path, os.path.join(path, "manifest.json")):
        with pytest.raises(fp.CheckpointNotFoundError) as caught:
            fp.load(path)
        assert isinstance(caught.value, FileNotFoundError) and isinstance(caught.value, fp.FastPersistError)
        assert caught.value.errno == 2 and caught.value.filename == missing
        fp.save({"a": 1}, path)
        os.remove(os.path.join(path, "manifest.json"))
    with pytest.raises(FileNotFoundError):
        fp.verify(path)


# ----------------------------------------------------------------------------- no code runs


RAN: list[str] = []


class Payload(collections.namedtuple("Payload", ["cmd", "arg"])):
    """A namedtuple whose construction has side effects: they must never run during a load."""

    __slots__ = ()

    @classmethod
    def _make(cls, iterable: typing.Iterable[object]) -> Payload:
        RAN.append("_make")
        return super()._make(iterable)

    def __new__(cls, cmd: str, arg: object) -> Payload:
        RAN.append("__new__")
        return super().__new__(cls, cmd, arg)


def test_a_payload_class_never_runs_unless_allow_listed(workdir: str) -> None:
    path = os.path.join(workdir, "p")
    fp.save({"x": Payload("rm -rf /", torch.ones(2))}, path)
    RAN.clear()
    back = fp.load(path)["x"]
    assert RAN == [], "a class named by the checkpoint ran during load"
    assert type(back) is not Payload and type(back).__name__ == "Payload"
    assert back._fields == ("cmd", "arg") and back.cmd == "rm -rf /" and torch.equal(back.arg, torch.ones(2))
    # The caller can opt in explicitly, and then (only then) the class is used.
    again = fp.load(path, namedtuple_types=[Payload])["x"]
    assert type(again) is Payload and RAN == ["_make"]


# ----------------------------------------------------------------------------- confinement


def _rewrite(path: str, edit: Callable[[dict[str, typing.Any]], None]) -> None:
    manifest = os.path.join(path, "manifest.json")
    doc = json.load(open(manifest))
    doc.pop("manifest_sha256")
    edit(doc)
    open(manifest, "wb").write(seal(json.dumps(doc).encode()))


def _victim(parent: str, checkpoint: str) -> str:
    """A directory outside the stripe roots whose name passes every rule for `checkpoint`'s stripes."""
    victim = os.path.join(parent, f"data.{fp.inspect(checkpoint)['checkpoint_id'][:12]}.fpstripe")
    os.makedirs(victim)
    Path(victim, "keep.txt").write_text("mine")
    return victim


def test_a_hostile_manifest_cannot_make_fastpersist_delete_outside_its_stripe_roots(workdir: str) -> None:
    ssd = os.path.join(workdir, "ssd")
    os.mkdir(ssd)
    cfg = fp.Config(stripes=[ssd])
    path = os.path.join(workdir, "ck")
    fp.save({"w": torch.ones(10)}, path, config=cfg)
    precious = os.path.join(workdir, "precious")
    victim = _victim(precious, path)
    _rewrite(path, lambda d: d["stripes"].append(victim))
    assert fp.load(path)["w"].sum() == 10  # the manifest is accepted: only deletion is at stake
    fp.save({"w": torch.zeros(10)}, path, config=cfg)  # replaces the hostile checkpoint, deleting it
    assert fp.wait_removed(timeout=60)  # (after the commit, in the background)
    assert Path(victim, "keep.txt").read_text() == "mine"
    assert torch.equal(fp.load(path)["w"], torch.zeros(10)) and len(os.listdir(ssd)) == 1
    # Retention in a Checkpointer is confined the same way.
    ck = fp.Checkpointer(os.path.join(workdir, "run"), keep=1, config=cfg)
    ck.save(1, {"w": torch.ones(2)})
    ck.wait()
    victim2 = _victim(precious, ck.path(1))
    _rewrite(ck.path(1), lambda d: d["stripes"].append(victim2))
    ck.save(2, {"w": torch.ones(2)})
    ck.close()  # the save and the removal of step 1
    assert ck.steps() == [2] and Path(victim2, "keep.txt").read_text() == "mine"
    assert len(os.listdir(ssd)) == 2  # step 1's own stripe directory went with it


@pytest.mark.parametrize(
    "bad_stripe",
    [
        "/etc",
        "/tmp/../etc/x.{id}.fpstripe",
        "relative/x.{id}.fpstripe",
        "/tmp/x.000000000000.fpstripe",
        "/t/\x00.{id}.fpstripe",
    ],
)
def test_stripe_paths_that_a_save_cannot_have_written_are_refused(workdir: str, bad_stripe: str) -> None:
    path = os.path.join(workdir, "ck")
    fp.save({"w": torch.ones(10)}, path)
    ident = fp.inspect(path)["checkpoint_id"][:12]
    _rewrite(path, lambda d: d["stripes"].append(bad_stripe.replace("{id}", ident)))
    for op in (fp.load, fp.verify, fp.inspect):
        with pytest.raises(fp.CorruptCheckpointError, match="stripe"):
            op(path)


def test_symlinks_cannot_lead_a_load_out_of_the_checkpoint(workdir: str) -> None:
    ssd = os.path.join(workdir, "ssd")
    os.mkdir(ssd)
    path = os.path.join(workdir, "ck")
    fp.save({"w": torch.ones(1000)}, path, config=fp.Config(stripes=[ssd]))
    data = fp.inspect(path)["files"][0]["path"]
    outside = os.path.join(workdir, "secret.bin")
    shutil.copyfile(data, outside)  # same size and content: only the link itself is wrong
    os.remove(data)
    os.symlink(outside, data)
    for op in (fp.load, fp.verify):
        with pytest.raises(fp.CorruptCheckpointError, match="not a regular file"):
            op(path)
    os.remove(data)
    shutil.copyfile(outside, data)
    # A stripe directory replaced by a link to a copy elsewhere is refused too.
    stripe_dir = os.path.dirname(data)
    moved = os.path.join(workdir, "elsewhere")
    os.rename(stripe_dir, moved)
    os.symlink(moved, stripe_dir)
    with pytest.raises(fp.CorruptCheckpointError, match="not a plain directory"):
        fp.load(path)
    os.remove(stripe_dir)
    os.rename(moved, stripe_dir)
    # Confined to configured roots when the caller gives them.
    with pytest.raises(fp.CorruptCheckpointError, match="outside the configured stripe roots"):
        fp.load(path, config=fp.Config(stripes=[workdir]))
    assert torch.equal(fp.load(path, config=fp.Config(stripes=[ssd]))["w"], torch.ones(1000))
    manifest = os.path.join(path, "manifest.json")
    os.rename(manifest, manifest + ".real")
    os.symlink(manifest + ".real", manifest)
    with pytest.raises(fp.CorruptCheckpointError, match="symbolic link"):
        fp.load(path)
