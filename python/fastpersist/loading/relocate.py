"""Stripe directories under new roots: reading a checkpoint whose stripes were moved.

A manifest records the absolute path of each stripe directory it wrote. When a checkpoint is
copied or moved together with its stripe directories to other drives, those paths are stale;
``Config(stripes=[new roots])`` given to ``load``, ``verify`` or ``inspect`` maps each recorded
stripe directory to the directory of the same name directly inside one of the given roots.
Give the new roots in the order the save had its own (one save names its stripe directories
alike in every root, so the order says which is which). Confinement holds: the names were
checked when the manifest was read (``NAME.ID[.rN|.wN].fpstripe`` with this checkpoint's id),
and only a directory of that name directly inside a given root is used; a recorded directory
that already sits in one of the roots stays where it is.

Example:
    >>> import fastpersist as fp, torch, os, shutil
    >>> old, new = "/tmp/fp-doc-relocate/old", "/tmp/fp-doc-relocate/new"
    >>> shutil.rmtree("/tmp/fp-doc-relocate", ignore_errors=True); os.makedirs(old); os.makedirs(new)
    >>> _ = fp.save({"w": torch.ones(2)}, "/tmp/fp-doc-relocate/ck", config=fp.Config(stripes=[old]))
    >>> for name in os.listdir(old):
    ...     _ = shutil.move(os.path.join(old, name), new)
    >>> fp.load("/tmp/fp-doc-relocate/ck", config=fp.Config(stripes=[new]))["w"].tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from ..errors import CorruptCheckpointError
from ..format.manifest import Manifest, read_manifest
from .opened import OpenedCheckpoint

__all__ = ["StripeRoots", "check_stripes_present", "read_opened", "relocate_stripes"]

#: The stripe roots a caller gave (``Config.stripes``), or None.
StripeRoots = Sequence[str | os.PathLike[str]] | None


def read_opened(ck: OpenedCheckpoint, stripe_roots: StripeRoots = None) -> Manifest:
    """The validated manifest of the opened checkpoint `ck`, its stripe directories looked up
    in `stripe_roots` when given (:func:`relocate_stripes`)."""
    return relocate_stripes(read_manifest(ck.at), ck.root, stripe_roots)


def relocate_stripes(m: Manifest, root: str, stripe_roots: StripeRoots) -> Manifest:
    """`m` with each stripe directory found by its name directly inside `stripe_roots` (the
    checkpoint `root` names it in messages); `m` itself when no roots are given.

    One save names its stripe directories alike in every stripe root, so where a name is in
    several of the roots, the roots are taken in the order the save had its own: when there are
    as many as the manifest's stripe roots, the i-th recorded root's directory is looked up in
    the i-th given root.

    Raises:
        CorruptCheckpointError: a stripe directory holding data files is in none of the roots,
            in several of them (and the order does not say which), or two would be one.
    """
    if not stripe_roots or not m.stripes:
        return m
    roots = [os.path.abspath(os.fspath(r)) for r in stripe_roots]
    real_roots = {os.path.realpath(r) for r in roots}
    parents = list(dict.fromkeys(os.path.dirname(d) for d in m.stripes))
    used = {f.stripe for f in m.files}
    found: list[str] = []
    for index, recorded in enumerate(m.stripes):
        name = os.path.basename(recorded)
        if os.path.realpath(os.path.dirname(recorded)) in real_roots and os.path.lexists(recorded):
            found.append(recorded)
            continue
        candidates = [os.path.join(r, name) for r in roots if os.path.lexists(os.path.join(r, name))]
        if len(candidates) > 1 and len(parents) == len(roots):
            by_order = os.path.join(roots[parents.index(os.path.dirname(recorded))], name)
            candidates = [by_order] if by_order in candidates else candidates
        if len(candidates) == 1 or (candidates and index not in used):
            found.append(candidates[0])
        elif index not in used:
            found.append(recorded)
        else:
            raise _not_found(m, root, roots, recorded, candidates)
    reading = [found[i] for i in sorted(s for s in used if s is not None)]
    if len(set(reading)) < len(reading):
        twice = next(d for d in reading if reading.count(d) > 1)
        raise CorruptCheckpointError(
            f"two stripe directories of {root} would both be read from {twice}: give one root for each of the "
            f"save's {len(parents)} stripe roots ({', '.join(parents)}), in the same order"
        )
    return dataclasses.replace(m, stripes=found)


def _not_found(
    m: Manifest, root: str, roots: list[str], recorded: str, candidates: list[str]
) -> CorruptCheckpointError:
    name = os.path.basename(recorded)
    if candidates:
        parents = list(dict.fromkeys(os.path.dirname(d) for d in m.stripes))
        return CorruptCheckpointError(
            f"stripe directory {name} of {root} is in several of the stripe roots ({', '.join(candidates)}): give "
            f"one root for each of the save's {len(parents)} stripe roots ({', '.join(parents)}), in the same order"
        )
    if os.path.lexists(recorded):
        return CorruptCheckpointError(
            f"stripe directory {recorded} of {root} is outside the configured stripe roots {roots}, and none of "
            f"them holds a directory named {name}: give the roots that hold the checkpoint's stripe directories"
        )
    return CorruptCheckpointError(
        f"stripe directory {name} of {root} (recorded at {recorded}) is in none of the configured stripe "
        f"roots {roots}: give the roots the stripe directories were copied or moved to"
    )


def check_stripes_present(m: Manifest, root: str) -> None:
    """Refuses a checkpoint whose stripe directories holding data files are missing, saying how
    to read a checkpoint whose stripes were moved (before the files are reported one by one)."""
    for index, directory in enumerate(m.stripes):
        held = sum(1 for f in m.files if f.stripe == index)
        if held and not os.path.lexists(directory):
            raise CorruptCheckpointError(
                f"stripe directory {directory} of {root} is missing (it held {held} of the checkpoint's data "
                "files). If the checkpoint was copied or moved with its stripe directories to other drives, pass "
                "their new roots, in the order the save had them: fp.load(path, config=fp.Config(stripes=[...])) "
                "(also fp.verify and fp.inspect, or --stripes DIR... on the command line); each stripe directory "
                f"is then looked up by its name, {os.path.basename(directory)}, directly inside those roots"
            )
