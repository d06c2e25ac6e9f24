"""The levels a :class:`~fastpersist.Checkpointer` keeps beyond its root, one object each.

``Checkpointer(root, group=g, levels=[Partner(replicas=1), Remote("s3://b/run1", every=100)])``:
each object holds one level's settings, checks them when it is made, and is attached to the
Checkpointer that is given it (:meth:`attach`), which makes the level's running part (its
copies, its drain, its export thread). A level that copies committed steps elsewhere in the
background (the remote level, the Hugging Face export) is a
:class:`~fastpersist.levels.host.CommittedStepCopies`, which the Checkpointer's commit sequence
calls in the order the levels were given; the partner level becomes the root level
(:class:`~fastpersist.levels.host.RootLevel`), in place of the local level alone. The local level is
the root itself (a directory under ``/dev/shm`` makes it an in-memory level, docs/levels.md).

Example:
    >>> Remote("/shared/run1", every=100)
    Remote(place='/shared/run1', every=100, keep=2, bytes_per_s=None)
    >>> Partner(replicas=0)
    Traceback (most recent call last):
    ...
    ValueError: Partner(replicas=0): expected an integer >= 1 (the copies of each rank's share on other nodes)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from ..arguments import given_path
from .background_exports import HfExports, hf_exports_for
from .host import LevelHost
from .partner_level import PartnerLevel
from .remote_level import RemoteLevel

__all__ = ["HFExport", "Level", "Partner", "Remote", "levels_given", "root_and_copies"]


@dataclass(frozen=True)
class Partner:
    """The partner level: each rank's share of a step is also kept in the roots of `replicas`
    other nodes (a node is ``$FASTPERSIST_NODE`` or the host name; each node passes its own
    root), so losing a node loses no step. Needs the Checkpointer's `group`. See docs/levels.md."""

    replicas: int = 1

    def __post_init__(self) -> None:
        if type(self.replicas) is not int or self.replicas < 1:
            raise ValueError(
                f"Partner(replicas={self.replicas!r}): expected an integer >= 1 (the copies of each rank's share on "
                "other nodes)"
            )

    def attach(self, host: LevelHost) -> PartnerLevel:
        return PartnerLevel(host, self.replicas)


@dataclass(frozen=True)
class Remote:
    """The remote level: committed steps drained in the background to `place`, a directory on a
    shared filesystem or an ``s3://bucket/prefix`` URL (S3-compatible stores; endpoint and
    credentials from the AWS environment variables, docs/levels.md#credentials), and restored
    from when no local or partner copy of a newer step of this run is left.

    Args:
        place: refused (ValueError, at attach) when it is the root, lies inside it or holds it,
            or is another live Checkpointer's remote.
        every: drain a step whenever a multiple of `every` was crossed since the last one drained
            (the first saved step is drained too); None: as often as one drain at a time allows,
            or, with the Checkpointer's `failures`, the multi-level advisor's choice from each
            drain's measured cost (docs/advisor.md, "Several levels").
        keep: committed remote steps to keep (>= 1).
        bytes_per_s: the drain's throttle (None: unthrottled); the drain also pauses while a save
            is staging and yields half its time to a save that is writing.
    """

    place: str | os.PathLike[str]
    every: int | None = None
    keep: int = 2
    bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        expected = "a directory on a shared filesystem or an s3://bucket/prefix URL"
        given_path(self.place, "place", "Remote", expected)
        if self.every is not None and (type(self.every) is not int or self.every < 1):
            raise ValueError(f"Remote(every={self.every!r}): expected an integer >= 1 or None")
        if type(self.keep) is not int or self.keep < 1:
            raise ValueError(f"Remote(keep={self.keep!r}): expected an integer >= 1")
        rate = self.bytes_per_s
        # bool is an int to isinstance: True would be a throttle of 1 byte/s, a drain that never ends.
        if rate is not None and not (type(rate) in (int, float) and math.isfinite(rate) and rate > 0):
            raise ValueError(f"Remote(bytes_per_s={rate!r}): expected a positive number of bytes per second or None")

    def attach(self, host: LevelHost) -> RemoteLevel:
        return RemoteLevel(host, self.place, self.every, self.keep, self.bytes_per_s, host.failures)


@dataclass(frozen=True)
class HFExport:
    """A background export of committed steps to `export_dir` as Hugging Face safetensors,
    whenever a multiple of `every` was crossed since the last export (the first committed step
    too), from the committed checkpoint on disk (:mod:`fastpersist.levels.background_exports`);
    `key` and `prefix` as in :func:`fastpersist.export_hf`."""

    export_dir: str | os.PathLike[str]
    every: int
    key: str | None = None
    prefix: str = ""

    def __post_init__(self) -> None:
        given_path(self.export_dir, "export_dir", "HFExport")
        if type(self.every) is not int or self.every < 1:
            raise ValueError(f"HFExport(every={self.every!r}): expected an integer >= 1")
        if self.key is not None and type(self.key) is not str:
            raise TypeError(
                f"HFExport(key={self.key!r}): expected None or a str (the key path of the model's state, as in "
                "fastpersist.export_hf)"
            )
        if type(self.prefix) is not str:
            raise TypeError(f"HFExport(prefix={self.prefix!r}): expected a str")

    def attach(self, host: LevelHost) -> HfExports:
        root = os.path.realpath(host.root)
        target = os.path.realpath(os.fspath(self.export_dir))
        if target == root or target.startswith(root.rstrip("/") + "/"):
            raise ValueError(
                f"HFExport(export_dir={os.fspath(self.export_dir)!r}): it is the Checkpointer's root {host.root} or "
                "lies inside it, where the exports would mix with the steps the root's cleaning and retention manage; "
                "give a directory outside the root"
            )
        return hf_exports_for(host, self.every, self.export_dir, self.key, self.prefix)


#: What ``Checkpointer(levels=...)`` takes.
Level = Partner | Remote | HFExport


def levels_given(levels: object, group: object) -> list[Level]:
    """`levels` as a list, each a level object, at most one of each kind, that the Checkpointer's
    `group` allows; or a TypeError/ValueError that says what was given."""
    if levels is None:
        return []
    if isinstance(levels, (str, bytes, os.PathLike)) or not hasattr(levels, "__iter__"):
        raise TypeError(
            f"levels={levels!r}: expected a list of level objects, e.g. [fastpersist.Partner(replicas=1), "
            "fastpersist.Remote('s3://bucket/prefix')]"
        )
    given = list(levels)
    seen: set[type] = set()
    for level in given:
        if not isinstance(level, (Partner, Remote, HFExport)):
            raise TypeError(
                f"levels=[..., {level!r}, ...]: expected fastpersist.Partner, fastpersist.Remote or "
                "fastpersist.HFExport"
            )
        if type(level) in seen:
            raise ValueError(f"levels=: more than one {type(level).__name__} level (give one of each kind)")
        seen.add(type(level))
        if isinstance(level, Partner) and group is None:
            raise ValueError(f"{level}: needs the Checkpointer's group=: the copies go to ranks on other nodes")
        if isinstance(level, HFExport) and any(isinstance(other, Partner) for other in given):
            raise ValueError(f"{level}: not supported with the Partner level yet")
    return given


def root_and_copies(levels: list[Level]) -> tuple[Partner | None, list[Remote | HFExport]]:
    """`levels` (as :func:`levels_given` returned them) split into the one that takes over the
    root level (a :class:`Partner`, or None: the local level alone) and the levels of copies,
    in the order given."""
    partner = next((level for level in levels if isinstance(level, Partner)), None)
    return partner, [level for level in levels if not isinstance(level, Partner)]


def moved_keywords_error(old: dict[str, Any]) -> TypeError:
    """The error for Checkpointer keywords that became level objects (or the failure model),
    showing the call's new form; any other unknown keyword is named as Python names it."""
    family = {
        "replicas": "Partner",
        "remote": "Remote",
        "remote_every": "Remote",
        "remote_keep": "Remote",
        "remote_bytes_per_s": "Remote",
        "export_hf_every": "HFExport",
        "export_dir": "HFExport",
        "export_hf_key": "HFExport",
        "export_hf_prefix": "HFExport",
    }
    unknown = [k for k in old if k not in family and k != "mtbf_s"]
    if unknown:
        return TypeError(f"Checkpointer() got an unexpected keyword argument {unknown[0]!r}")
    levels: list[str] = []
    if "replicas" in old:
        levels.append(f"fastpersist.Partner(replicas={old['replicas']!r})")
    remote = [k for k in old if family.get(k) == "Remote"]
    if remote:
        args = [repr(old.get("remote", "..."))]
        args += [f"{k.removeprefix('remote_')}={old[k]!r}" for k in remote if k != "remote"]
        levels.append(f"fastpersist.Remote({', '.join(args)})")
    export = [k for k in old if family.get(k) == "HFExport"]
    if export:
        args = [repr(old.get("export_dir", "..."))]
        args += [f"{k.removeprefix('export_hf_')}={old[k]!r}" for k in export if k != "export_dir"]
        levels.append(f"fastpersist.HFExport({', '.join(args)})")
    new = [f"levels=[{', '.join(levels)}]"] if levels else []
    if "mtbf_s" in old:
        new.append(f"failures=fastpersist.Failures(process_mtbf_s={old['mtbf_s']!r})")
    given = ", ".join(f"{k}={v!r}" for k, v in old.items())
    return TypeError(f"Checkpointer({given}): these keywords became objects; write Checkpointer(..., {', '.join(new)})")
