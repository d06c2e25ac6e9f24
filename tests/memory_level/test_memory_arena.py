"""A device state saved to the in-memory level is staged straight into its data file's pages: the
file is the arena (``Arena.over_file``, ``Arenas.lease_file``), kept and reused as retention
recycles the file, and the job only checksums it (``job/memory/in_place.rs``)."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import pytest
import torch

import fastpersist as fp
from fastpersist import _core
from fastpersist.format.layout import data_file_name
from fastpersist.gpu.arenas import ARENAS, Arenas
from fastpersist.gpu.copiers import use_copier
from fastpersist.memory_level.recycle import file_to_stage_in, is_memory_root
from fastpersist.memory_level.spares import wait_spare

from fake_cuda import LaterCopier
from gloo import HELPERS_DIR

SHM = "/dev/shm"
pytestmark = pytest.mark.skipif(not (os.path.isdir(SHM) and is_memory_root(SHM)), reason="needs a tmpfs at /dev/shm")
DATA = data_file_name(writer=0, stripe=0)
CHUNK = 256 << 10


class RecordingCopier(LaterCopier):
    """A fake copy engine on a thread of its own that records where its copies land."""

    delay_s = 0.0
    destinations: ClassVar[list[tuple[int, int]]] = []

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, early: bool = False) -> None:
        RecordingCopier.destinations += [(dst.data_ptr(), dst.numel()) for _, dst in pairs]
        super().copy(pairs, early=early)


@pytest.fixture
def on_device() -> Iterator[set[int]]:
    """Tensors whose storage is in the set are staged by RecordingCopier, as GPU tensors are."""
    RecordingCopier.destinations = []
    ARENAS.clear()
    storages: set[int] = set()
    with use_copier(lambda t: t.numel() > 0 and t.untyped_storage().data_ptr() in storages, RecordingCopier):
        yield storages
    ARENAS.clear()


def device_state(on_device: set[int], step: int, n: int = 300_000) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    state = {"w": torch.randn(n, generator=g), "m": torch.randn(70_001, generator=g), "step": step}
    state["host"] = torch.arange(step, step + 1000)  # copied by the job, beside the device copies
    state["tied"] = state["w"]  # one tensor under two names: copied once
    on_device.update(state[k].untyped_storage().data_ptr() for k in ("w", "m"))
    return state


def file_arenas() -> dict[tuple[int, int], tuple[int, int]]:
    """(st_dev, st_ino) of each kept file arena's file -> (address, length)."""
    out = {}
    for kept in ARENAS._kept:
        status = kept.arena.file_status
        if status is not None:
            out[status[0]] = (kept.arena.address, kept.arena.len_bytes)
    return out


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def identity(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def config(**knobs: Any) -> fp.Config:
    return fp.Config(chunk_bytes=CHUNK, **knobs)


@pytest.mark.parametrize("checksum", ["crc32c", "off"])
def test_device_bytes_land_in_the_recycled_step_files_whose_arenas_serve_every_later_save(
    shm_root: str, on_device: set[int], backend: str, checksum: str
) -> None:
    in_place: set[tuple[int, int]] = set()
    with fp.Checkpointer(shm_root, every=1, keep=2, config=config(backend=backend, checksum=checksum)) as ck:
        for step in range(12):
            state = device_state(on_device, step)
            RecordingCopier.destinations = []
            ck.save(step, state)
            ck.wait_staged()
            state["w"].add_(1)  # after wait_staged: never in this step
            ck.wait()
            arenas = file_arenas()
            data = identity(os.path.join(ck.path(step), DATA))
            assert len(RecordingCopier.destinations) == 2  # one copy per device tensor
            start, length = arenas.get(data, (0, 0))
            inside = [start <= p and p + n <= start + length for p, n in RecordingCopier.destinations]
            wait_spare()  # made after each of the first commits (spares.py), for the next save
            if step == 0:
                assert not any(inside) and data not in arenas  # a new file: an anonymous arena
                continue
            assert all(inside), step  # a spare or a recycled file: staged into its own pages
            in_place.add(data)
            if step == 3:
                kept = list(ARENAS._kept)  # keep + 1 files rotate: no arena is made from here on
            elif step > 3:
                assert ARENAS._kept == kept
        assert len(in_place) == 3
        for step in ck.steps():
            fp.verify(ck.path(step))
            got = ck.load(step)
            want = device_state(set(), step)
            assert torch.equal(got["w"], want["w"]) and torch.equal(got["m"], want["m"])
            assert torch.equal(got["host"], want["host"]) and got["step"] == step
            assert got["tied"].data_ptr() == got["w"].data_ptr()  # still one tensor


def test_repeated_saves_to_one_path_never_map_a_new_file(shm_root: str, on_device: set[int]) -> None:
    for step in range(3):  # each save replaces the last: a new file every time, never recycled
        fp.save(device_state(on_device, step), shm_root, config=config())
    assert file_arenas() == {}
    assert torch.equal(fp.load(shm_root)["w"], device_state(set(), 2)["w"])


def test_a_new_process_restores_the_newest_step_staged_in_place(shm_root: str, on_device: set[int]) -> None:
    with fp.Checkpointer(shm_root, every=1, keep=1, config=config()) as ck:
        for step in range(5):  # steps 2-4 are staged into the recycled files of steps 0-2
            ck.save(step, device_state(on_device, step))
            ck.wait()  # retired and recycled before the next save
    assert len(file_arenas()) == 2
    code = textwrap.dedent(
        f"""
        import torch, fastpersist as fp
        ck = fp.Checkpointer({shm_root!r}, keep=1)
        got = ck.load()
        g = torch.Generator().manual_seed(4)
        w, m = torch.randn(300_000, generator=g), torch.randn(70_001, generator=g)
        print(ck.latest(), torch.equal(got["w"], w), torch.equal(got["m"], m))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HELPERS_DIR, timeout=120)
    assert out.stdout.split() == ["4", "True", "True"], out.stderr


def test_a_bound_too_small_for_the_file_stages_through_an_anonymous_arena(shm_root: str, on_device: set[int]) -> None:
    with fp.Checkpointer(shm_root, keep=1, config=config(pinned_bytes=2 << 20)) as ck:
        for step in range(3):
            ck.save(step, device_state(on_device, step, n=600_000))  # 2.7 MB
            ck.wait()
    assert file_arenas() == {} and ARENAS.total_bytes() <= 2 << 20  # went in windows
    got, want = ck.load(2), device_state(set(), 2, n=600_000)
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["m"], want["m"])


def test_a_deleted_root_gives_its_files_arenas_back_at_the_next_save(
    shm_root: str, on_device: set[int], workdir: str
) -> None:
    with fp.Checkpointer(shm_root, keep=1, config=config()) as ck:
        for step in range(3):
            ck.save(step, device_state(on_device, step))
            ck.wait()
            wait_spare()
    assert len(file_arenas()) == 2  # keep + 1 files rotate (the second a spare), each with its arena
    shutil.rmtree(shm_root)
    fp.save(device_state(on_device, 1), os.path.join(workdir, "disk"), config=config())  # a disk save
    assert file_arenas() == {}


def test_only_one_data_file_written_in_memory_is_staged_in_place(shm_root: str, workdir: str) -> None:
    class Part:
        len_bytes = 4096

    tmp = os.path.dirname(shm_root)  # a directory on the tmpfs
    inside = os.path.join(tmp, DATA)
    assert file_to_stage_in([inside], [Part()], tmp, backend="auto", direct_io="auto") == (inside, 4096)
    assert file_to_stage_in([inside], [Part()], tmp, backend="auto", direct_io="require") is None  # O_DIRECT asked for
    assert file_to_stage_in([inside], [Part()], tmp, backend="null", direct_io="auto") is None
    assert file_to_stage_in([inside, inside + "1"], [Part(), Part()], tmp, backend="auto", direct_io="auto") is None
    assert (
        file_to_stage_in([os.path.join(SHM, "stripe", DATA)], [Part()], tmp, backend="auto", direct_io="auto") is None
    )
    on_disk = os.path.join(workdir, "t")
    assert file_to_stage_in([os.path.join(on_disk, DATA)], [Part()], on_disk, backend="auto", direct_io="auto") is None
    assert _core.writes_in_memory([inside], "threads", "off")


def test_a_full_memory_filesystem_fails_the_save_naming_the_file_and_keeps_the_last_step(
    on_device: set[int], tmp_path: Any
) -> None:
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(small)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        root = str(small / "ck")
        with fp.Checkpointer(root, keep=1, config=config()) as ck:
            for step in range(3):
                state = {"w": torch.full((100_000,), float(step))}
                on_device.add(state["w"].untyped_storage().data_ptr())
                ck.save(step, state)
                ck.wait()
                wait_spare()
            assert len(file_arenas()) == 2  # step 1 took a spare, step 2 step 0's recycled file
            big = {"w": torch.ones(1_000_000)}  # 4 MB: more than the filesystem holds
            on_device.add(big["w"].untyped_storage().data_ptr())
            with pytest.raises(OSError) as raised:  # step 1's recycled file cannot grow to it
                ck.save(3, big)
                ck.wait()
            assert DATA in str(raised.value), raised.value
        assert ck.latest() == 2 and torch.equal(ck.load(2)["w"], torch.full((100_000,), 2.0))
        assert not [n for n in os.listdir(root) if ".fptmp-" in n]
    finally:
        ARENAS.clear()
        subprocess.run(["umount", "-l", str(small)])


def test_file_arenas_that_fill_the_bound_make_way_for_a_save_that_needs_an_arena(shm_root: str) -> None:
    os.makedirs(shm_root)
    arenas, size, cap = Arenas(), 1_500_000, 3 << 20  # two file arenas fill the bound
    for name in ("a", "b"):
        path = os.path.join(shm_root, name)
        with open(path, "wb") as f:
            f.write(b"\1" * size)  # a recycled file: whole, at the save's length
        for _ in range(2):  # mapped by its first save, kept for the next
            leased = arenas.lease_file(path, size, cap_bytes=cap, pin=False)
            assert leased is not None and leased[0].arena.over_a_file
            assert bytes(leased[1][:2].numpy()) == b"\1\1"  # the file's own bytes
            del leased
    assert arenas.total_bytes() == 2 * round_up(size, _core.DIRECT_ALIGN_BYTES)
    # Only their own files' saves lease them: a save of a new file must not wait for them.
    lease, _ = arenas.lease(2 << 20, cap_bytes=cap, min_bytes=CHUNK, pin=False, wait=False)
    assert not lease.arena.over_a_file and arenas.total_bytes() <= cap
    assert arenas.lease_file(os.path.join(shm_root, "new"), size, cap_bytes=cap, pin=False) is None  # absent
    assert not os.path.exists(os.path.join(shm_root, "new"))


def test_every_step_on_the_memory_level_and_the_disk_as_often_as_it_allows(
    shm_root: str, on_device: set[int], workdir: str
) -> None:
    # The GPU every-step recipe of docs/levels.md: every step into /dev/shm (each into its
    # recycled file), a disk directory drained in the background whenever the last drain is done.
    disk = os.path.join(workdir, "disk")
    futures = {}
    with fp.Checkpointer(shm_root, every=1, keep=2, levels=[fp.Remote(disk, every=None)], config=config()) as ck:
        for step in range(10):
            futures[step] = ck.save(step, device_state(on_device, step))
            ck.wait_staged()
    # A step due while the disk still wrote waited as a snapshot; a newer one may have replaced
    # it (cancelled, never written). Which did depends on timing; the newest always commits.
    committed = [s for s, f in futures.items() if f is not None and not f.cancelled()]
    assert all(futures[s].result() is not None for s in committed)
    assert committed[-1] == 9 and committed[0] == 0, futures
    levels = ck.levels()  # closed: the drain of the newest due step is done
    local = levels["local"]["steps"]
    # The newest keep committed steps, and one a drain may still be reading (kept until it is done).
    assert set(committed[-2:]) <= set(local) <= set(committed) and len(local) <= 3, (committed, levels)
    drained = levels["remote"]["steps"]
    assert drained and set(drained) <= set(committed) and max(drained) == 9, levels
    # No arena outlives its file (that recycled files get theirs, by a fixed schedule:
    # test_device_bytes_land_in_the_recycled_step_files_whose_arenas_serve_every_later_save).
    live = [k for k in ARENAS._kept if k.over_file and k.arena.file_status[1]]
    assert len(live) <= 4  # the local steps' files and the one in the recycle directory
    for step in committed[-2:]:
        got, want = ck.load(step), device_state(set(), step)
        assert torch.equal(got["w"], want["w"]) and torch.equal(got["host"], want["host"])
    shutil.rmtree(shm_root)  # the node's memory is gone: the disk level restores its newest step
    again = fp.Checkpointer(shm_root, keep=2, levels=[fp.Remote(disk)])
    step = again.latest()
    assert step == max(drained)
    assert torch.equal(again.load(step)["w"], device_state(set(), step)["w"])


class PinnedRecordingCopier(RecordingCopier):
    """RecordingCopier as CudaCopier is: its arenas are to be registered. Keeps the ranges its
    copies are landing in until they are waited for."""

    needs_pinned_memory = True
    in_flight: ClassVar[set[tuple[int, int]]] = set()

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, early: bool = False) -> None:
        mine = {(dst.data_ptr(), dst.numel()) for _, dst in pairs}
        self.mine = getattr(self, "mine", set()) | mine
        PinnedRecordingCopier.in_flight |= mine
        super().copy(pairs, early=early)

    def wait(self) -> None:
        super().wait()
        PinnedRecordingCopier.in_flight -= getattr(self, "mine", set())
        self.mine = set()


def test_a_files_arena_is_registered_once_off_the_save_and_let_go_before_another_write(
    shm_root: str, fake_runtime: Any
) -> None:
    ARENAS.clear()
    during_copies: list[int] = []
    register = fake_runtime.register

    def watched_register(address: int, nbytes: int) -> int:
        if any(address < p + n and p < address + nbytes for p, n in set(PinnedRecordingCopier.in_flight)):
            during_copies.append(address)
        return register(address, nbytes)

    fake_runtime.register = watched_register
    storages: set[int] = set()
    selects = lambda t: t.numel() > 0 and t.untyped_storage().data_ptr() in storages  # noqa: E731
    with use_copier(selects, PinnedRecordingCopier), fp.Checkpointer(shm_root, keep=2, config=config()) as ck:
        for step in range(9):
            ck.save(step, device_state(storages, step))
            ck.wait()
        ARENAS.wait_pinned()
        files = {k.arena.address for k in ARENAS._kept if k.over_file}  # no reference kept
        registered = [a for what, a in fake_runtime.calls if what == "register"]
        assert len(files) == 3 and all(registered.count(a) == 1 for a in files), (files, registered)
        assert during_copies == []  # never while a copy lands in the memory being registered

        # The state grows: the recycled file is written another way (an anonymous arena), at
        # another length, so its arena is let go (and unregistered) first.
        ck.save(9, device_state(storages, 9, n=310_000))
        ck.wait()
        # A host-only state: written through the engine's own mappings, so the same.
        ck.save(10, {"w": torch.ones(10)})
        ck.wait()
    gc.collect()
    unregistered = [a for what, a in fake_runtime.calls if what == "unregister"]
    assert len(set(files) & set(unregistered)) == 2, (files, unregistered)
    got = ck.load(9)
    assert torch.equal(got["w"], device_state(set(), 9, n=310_000)["w"])
    ARENAS.clear()
