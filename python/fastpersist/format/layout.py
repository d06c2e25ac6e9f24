"""Every name fastpersist gives a file or directory on disk, the patterns that recognise them,
and the one atomic write of a small file. Nothing outside ``format/`` spells one of these names.

What lies where (docs/format.md):

* a checkpoint ``NAME/``: ``manifest.json`` (written last), data files ``data-wW-sS.bin``
  (writer W, stripe S) and, sharded, one ``shard-RRRRR/`` directory per rank;
* beside it while a save runs: the temporary directory ``.NAME.fptmp-ID`` (ID: the first 12 hex
  digits of the checkpoint id), renamed onto ``NAME`` at commit;
* under each stripe root: ``NAME.ID[.rK|.wK].fpstripe`` (the tag names a rank or a writer);
* a :class:`~fastpersist.Checkpointer` root: ``step-NNNNNNNN/`` checkpoints, the index
  ``latest.json`` and the cost history ``history.json``;
* beside every file fastpersist replaces atomically (the index, an ``fp.torch_save`` file, a
  Hugging Face export's shards and index, a converted safetensors file; :func:`atomic_file`):
  the temporary file ``.NAME.fptmp-ID`` (ID: 12 random hex digits), held under an exclusive
  ``flock`` by its writer until it is renamed onto ``NAME``, so one whose lock can be taken is a
  dead writer's (:func:`remove_dead_tmp_files`; ``fastpersist clean``). Older versions wrote
  ``.latest.json.tmp-PID-TID``, still recognised (:data:`INDEX_TMP`);
* on a memory root (tmpfs), the recycle directory ``.fprecycle/`` holding retired steps' data
  files for a later save to overwrite in place (:mod:`fastpersist.memory_level.recycle`): one entry
  ``NAME.ID`` per retired step, never a checkpoint (its manifest is removed on the way in);
* a DCP directory (:mod:`fastpersist.integrations.dcp`): ``.metadata`` and ``__R_ID.fpdcp``
  (``__R_ID_I.fpdcp``, one per item, with ``single_file_per_rank=False``);
* the owner marker and the live-save lock of :mod:`fastpersist.format.ownership` (which owns
  those two names).

Example:
    >>> os.path.basename(tmp_dir_for("/ckpt/step-7", "0123456789abcdef"))
    '.step-7.fptmp-0123456789ab'
    >>> parse_tmp_dir(".step-7.fptmp-0123456789ab")
    ('step-7', '0123456789ab')
    >>> stripe_dir_name("step-00000012", "0123456789abcdef", ".w1")
    'step-00000012.0123456789ab.w1.fpstripe'
    >>> parse_stripe_dir("step-00000012.0123456789ab.r3.fpstripe")
    ('step-00000012', '0123456789ab')
    >>> data_file_name(writer=0, stripe=1), shard_name(3), step_dir_name(120)
    ('data-w0-s1.bin', 'shard-00003', 'step-00000120')
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import stat
import uuid
from collections.abc import Iterable, Iterator

import fastpersist._core as _core

from ..errors import CorruptCheckpointError
from .flocks import flock, lock_state, locked_dir
from .quote import shown

__all__ = [
    "DATA_FILE",
    "DCP_DATA_SUFFIX",
    "DCP_METADATA_NAME",
    "HISTORY_NAME",
    "INDEX_NAME",
    "INDEX_TMP",
    "MANIFEST_NAME",
    "RECYCLE_DIR",
    "SHARD_DIR",
    "STRIPE_SUFFIX",
    "TMP_MARKER",
    "atomic_file",
    "create_locked_file",
    "dead_tmp_files",
    "is_checkpointer_root",
    "is_dcp_checkpoint",
    "drained_marker_name",
    "check_stripe_dirs",
    "data_file_name",
    "data_file_origin",
    "linked_data_file_name",
    "dcp_data_file_name",
    "parse_step_dir",
    "parse_stripe_dir",
    "parse_tmp_dir",
    "recycle_entry_name",
    "remove_dead_tmp_files",
    "shard_name",
    "step_dir_name",
    "stripe_dir_id",
    "stripe_dir_name",
    "stripe_tag",
    "tmp_dir_for",
    "tmp_file_for",
    "read_small_file",
    "write_new_file",
    "write_small_file",
]

log = logging.getLogger("fastpersist")

#: A checkpoint's manifest, written last: its presence is what makes a directory a checkpoint.
MANIFEST_NAME = "manifest.json"
#: The names a manifest may give its data files (a save writes :func:`data_file_name`).
DATA_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
#: One rank's directory inside a sharded checkpoint.
SHARD_DIR = re.compile(r"^shard-\d{5}$")

TMP_MARKER = ".fptmp-"
_TMP_DIR = re.compile(r"^\.(.+)" + re.escape(TMP_MARKER) + r"([0-9a-f]{12})$")

STRIPE_SUFFIX = ".fpstripe"
_STRIPE_DIR = re.compile(r"^([A-Za-z0-9._-]{0,240})\.([0-9a-f]{12})(?:\.[rw]\d{1,6})?" + re.escape(STRIPE_SUFFIX) + "$")

#: A torch.distributed.checkpoint directory written by the DCP storage writer: DCP's own
#: metadata file, and one data file per rank and save.
DCP_METADATA_NAME = ".metadata"
DCP_DATA_SUFFIX = ".fpdcp"

_STEP_DIR = re.compile(r"^step-(\d{8,})$")
#: A Checkpointer's index: the step it last committed.
INDEX_NAME = "latest.json"
#: A Checkpointer's measured costs and wear (:mod:`fastpersist.advisor.history`).
HISTORY_NAME = "history.json"
#: A Checkpointer's index or cost history being replaced by a version before the temporary
#: files of :func:`atomic_file` (group 1: the writer's pid).
INDEX_TMP = re.compile(r"^\.(?:" + "|".join(map(re.escape, (INDEX_NAME, HISTORY_NAME))) + r")\.tmp-(\d+)-\d+$")


#: A memory root's retired data files, waiting to be overwritten by a later save. Garbage by
#: construction: nothing committed names anything in it.
RECYCLE_DIR = ".fprecycle"


def recycle_entry_name(name: str, checkpoint_id: str) -> str:
    """The entry in :data:`RECYCLE_DIR` of the retired checkpoint `name` (id `checkpoint_id`)."""
    return f"{name}.{checkpoint_id[:12]}"


def data_file_name(*, writer: int, stripe: int) -> str:
    """The data file of writer `writer` on stripe `stripe`."""
    return f"data-w{writer}-s{stripe}.bin"


_LINKED_DATA_FILE = re.compile(r"^(.+)\.from-([0-9a-f]{12})\.bin$")


def linked_data_file_name(name: str, checkpoint_id: str) -> str:
    """The name an incremental save gives a data file `name` of checkpoint `checkpoint_id` that it
    hard-links into its own directory: the name says which save wrote the bytes (kept as is when
    `name` was linked from an earlier save already).

    Example:
        >>> linked_data_file_name("data-w0-s0.bin", "0123456789abcdef")
        'data-w0-s0.from-0123456789ab.bin'
        >>> linked_data_file_name('data-w0-s0.from-0123456789ab.bin', "ffff")
        'data-w0-s0.from-0123456789ab.bin'
    """
    if _LINKED_DATA_FILE.match(name):
        return name
    stem = name[: -len(".bin")] if name.endswith(".bin") else name
    return f"{stem}.from-{checkpoint_id[:12]}.bin"


def data_file_origin(name: str, checkpoint_id: str) -> str:
    """The first 12 hex digits of the id of the save that wrote the data file `name` of checkpoint
    `checkpoint_id`: the checkpoint's own, or the one its linked name records."""
    linked = _LINKED_DATA_FILE.match(name)
    return linked.group(2) if linked else checkpoint_id[:12]


def shard_name(rank: int) -> str:
    """The directory of rank `rank`'s shard inside a sharded checkpoint."""
    return f"shard-{rank:05d}"


def tmp_dir_for(path: str, checkpoint_id: str) -> str:
    """The hidden temporary directory a save of `path` writes into before it commits."""
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}{TMP_MARKER}{checkpoint_id[:12]}")


def parse_tmp_dir(name: str) -> tuple[str, str] | None:
    """(checkpoint or file name, 12-hex id) of the name of a save's temporary directory or of an
    :func:`atomic_file` temporary file, or None if it is neither."""
    match = _TMP_DIR.match(name)
    return (match.group(1), match.group(2)) if match else None


def tmp_file_for(path: str) -> str:
    """A new hidden temporary name beside the file `path` (see :func:`atomic_file`)."""
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}{TMP_MARKER}{uuid.uuid4().hex[:12]}")


def stripe_dir_name(name: str, checkpoint_id: str, tag: str) -> str:
    """The directory a save of checkpoint `name` makes under each stripe root (`tag`: ``""``, ``".rK"``, ``".wK"``)."""
    return f"{name}.{checkpoint_id[:12]}{tag}{STRIPE_SUFFIX}"


def stripe_tag(*, rank: int | None = None, writer: int | None = None) -> str:
    """The tag in a stripe directory's name: a shard's rank, a replicated save's writer, or none."""
    if rank is not None:
        return f".r{rank}"
    return f".w{writer}" if writer is not None else ""


def parse_stripe_dir(name: str) -> tuple[str, str] | None:
    """(checkpoint name, 12-hex checkpoint id) of a stripe directory's name, or None if it is not one."""
    match = _STRIPE_DIR.match(name)
    return (match.group(1), match.group(2)) if match else None


def stripe_dir_id(name: str) -> str | None:
    """The 12-hex checkpoint id in a stripe directory's name, or None if it is not one."""
    parsed = parse_stripe_dir(name)
    return parsed[1] if parsed else None


def check_stripe_dirs(stripes: Iterable[str], checkpoint_id: str, where: str) -> None:
    """Refuses stripe paths a save of this checkpoint cannot have written (pure; no I/O).

    Raises:
        CorruptCheckpointError: naming the offending path.
    """
    for s in stripes:
        ok = (
            "\x00" not in s
            and os.path.isabs(s)
            and os.path.normpath(s) == s
            and not s.startswith("//")
            and stripe_dir_id(os.path.basename(s)) == checkpoint_id[:12]
            and len(checkpoint_id) >= 12
        )
        if not ok:
            raise CorruptCheckpointError(
                f"{where}: stripe directory {shown(s, 200)} is not a normalised absolute path ending in "
                f"NAME.{checkpoint_id[:12] or 'ID'}{STRIPE_SUFFIX}; fastpersist will not read or delete it"
            )


def dcp_data_file_name(rank: int, save_id: str) -> str:
    """The data file rank `rank` writes in the DCP save `save_id`: unique to that save."""
    return f"__{rank}_{save_id}{DCP_DATA_SUFFIX}"


def drained_marker_name(rank: int) -> str:
    """The marker rank `rank` leaves in a remote step directory once its files are there."""
    return f".fpdrained-{rank:05d}.json"


def step_dir_name(step: int) -> str:
    """The directory of a Checkpointer's checkpoint of `step`."""
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """The step a Checkpointer's checkpoint directory is named after, or None if it is not one."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def is_checkpointer_root(path: str) -> bool:
    """A directory that is not a checkpoint (no manifest) but holds step directories or an index."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, MANIFEST_NAME)):
        return False
    names = os.listdir(path)
    return INDEX_NAME in names or any(parse_step_dir(n) is not None for n in names)


def is_dcp_checkpoint(path: str) -> bool:
    """A directory written through the DCP plug-in: DCP's metadata file and no manifest."""
    has = os.path.exists
    return not has(os.path.join(path, MANIFEST_NAME)) and has(os.path.join(path, DCP_METADATA_NAME))


def create_locked_file(path: str) -> int:
    """Creates the file `path` (FileExistsError if something is there) holding an exclusive
    ``flock`` until its descriptor, returned, is closed: a cleaner sees it live, and once its
    writer is gone, dead (:func:`~fastpersist.format.flocks.lock_state`). Created under a shared
    lock of its directory, as a cleaner decides under an exclusive one: never between the two."""
    parent = os.path.dirname(os.path.abspath(path))
    with locked_dir(parent, fcntl.LOCK_SH):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, path)
        except BaseException:
            os.close(fd)
            os.remove(path)
            raise
    return fd


def fsync_tree(path: str, *, durable_already: Iterable[str] = ()) -> None:
    """Fsyncs every regular file under the directory `path`, then every directory, deepest first
    (an entry is durable once the directory naming it is synced after it), leaving out the trees
    in `durable_already`. Links are not followed. The directory holding `path` is the caller's:
    it syncs it after the rename that publishes `path`, or right away."""
    skip = {os.path.abspath(p) for p in durable_already}
    walked = []
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if os.path.abspath(os.path.join(root, d)) not in skip]
        for name in files:
            full = os.path.join(root, name)
            if os.path.isfile(full) and not os.path.islink(full):
                _core.fsync_path(full)
        walked.append(root)
    for root in reversed(walked):
        _core.fsync_dir(root)


@contextlib.contextmanager
def atomic_file(path: str, *, durable: bool) -> Iterator[str]:
    """Yields a temporary path beside `path` to write; on success it replaces `path` atomically.

    Readers see the old file or the new one, never a part. `durable`: the file is fsynced before
    the rename and the directory after it. On an error the temporary file is removed; a writer
    killed before that leaves it, and since the temporary is created holding an exclusive
    ``flock`` (until the rename), the next write of `path` and ``fastpersist clean`` of its
    directory recognise it as dead and remove it (:func:`remove_dead_tmp_files`). The yielded
    file exists, empty: write it by its path (open it for writing, or give it to the engine).
    """
    parent, name = os.path.split(os.path.abspath(path))
    remove_dead_tmp_files(parent, name)
    tmp = tmp_file_for(path)
    fd = create_locked_file(tmp)
    try:
        yield tmp
        if durable:
            _core.fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    finally:
        os.close(fd)  # the lock goes with it, after the rename (or the removal)
    if durable:
        _core.fsync_dir(parent)


def dead_tmp_files(parent: str, name: str | None = None) -> list[str]:
    """The temporary files of :func:`atomic_file` in `parent` (of the file `name` only, if
    given) whose writers are gone; call it under an exclusive :func:`locked_dir` of `parent`.
    A temporary on a filesystem without locks is never proven dead."""
    try:
        entries = sorted(os.scandir(parent), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        parsed = parse_tmp_dir(entry.name)
        if parsed is None or (name is not None and parsed[0] != name) or not entry.is_file(follow_symlinks=False):
            continue
        if lock_state(entry.path) == "dead":
            found.append(entry.path)
    return found


def remove_dead_tmp_files(parent: str, name: str | None = None) -> list[str]:
    """Removes what :func:`dead_tmp_files` finds (a killed writer's temporary files, up to the
    size of what it was writing); returns their paths."""
    try:
        names = os.listdir(parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    wanted = f".{name}{TMP_MARKER}" if name is not None else None
    if not any(parse_tmp_dir(n) and (wanted is None or n.startswith(wanted)) for n in names):
        return []  # the usual case, without a lock
    with locked_dir(parent, fcntl.LOCK_EX):
        found = dead_tmp_files(parent, name)
        for tmp in found:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
    for tmp in found:
        log.info("removed %s: a temporary file its writer left when it died", tmp)
    return found


def write_new_file(path: str, data: bytes, *, durable: bool) -> None:
    """Creates the file `path`, which must not exist, holding `data` (fsynced when `durable`;
    its directory entry is the caller's to make durable).

    Raises:
        FileExistsError: `path` exists already.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_small_file(path: str, data: bytes, *, durable: bool) -> None:
    """Replaces the file `path` with `data` atomically (see :func:`atomic_file`)."""
    with atomic_file(path, durable=durable) as tmp, open(tmp, "wb") as f:
        f.write(data)


def read_small_file(path: str, *, limit_bytes: int, follow_links: bool = False) -> bytes:
    """The bytes of the regular file `path`, at most `limit_bytes` of them.

    Every small file fastpersist reads in a root (the index, the cost history, a DCP
    ``.metadata``) comes through here, so a hostile or damaged root gives an error at once:
    a FIFO, device or socket in the file's place is refused without waiting for a writer (the
    open does not block), and a symbolic link is not followed unless `follow_links` (a file
    outside any root, such as the tuning cache).

    Raises:
        OSError: the file is missing (``FileNotFoundError``), a link (ELOOP), not a regular
            file (EINVAL), or over `limit_bytes` (EFBIG); the message names the file.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_links:
            raise OSError(
                errno.ELOOP, "a symbolic link where fastpersist keeps a regular file (links are not followed)", path
            ) from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, device or socket?); nothing waits on it", path)
        if st.st_size > limit_bytes:
            raise OSError(errno.EFBIG, f"{st.st_size} bytes, over the {limit_bytes}-byte limit for this file", path)
        return f.read(limit_bytes)
