"""`Commit`: the one sequence that makes a host's checkpoint count, whatever the host.

Every integration ends a checkpoint the same way, and only the host's hooks differ:

1. **wait**: `prepare` writes what the host writes itself while the saves run, then every one
   of the checkpoint's saves (:class:`~fastpersist.SaveFuture`) is waited for (after a failure
   the others are cancelled and still waited for, so no save outlives the commit), then
   `durable` makes this rank's other files durable;
2. **agree**: every rank says whether its part went well
   (:func:`~fastpersist.distributed.control.agree`); on a failure anywhere, `abandon` runs on
   every rank (a staging directory removed) and every rank raises, its own error first;
3. **publish** on the ranks that publish: the rename into place, ``latest``, an index;
   then every rank agrees again, so none goes on (to a load, say) before it is in place;
4. **retire** what the new checkpoint replaces (rotation), only once it is published.

What a failure leaves is the host's promise (`kept`, appended to the group's error): the
previous checkpoint, as it was.

Example:
    >>> done = []
    >>> Commit("ckpt-1", [], publish=lambda: done.append("publish"), retire=lambda: done.append("retire")).run()
    []
    >>> done
    ['publish', 'retire']
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..distributed.control import ControlGroup, agree
from ..futures import SaveFuture, SaveResult

__all__ = ["Commit", "wait_all"]


def wait_all(futures: Sequence[SaveFuture]) -> list[SaveResult]:
    """Waits for every future; after the first failure the rest are cancelled and waited for
    (none outlives this call); returns their results or raises the first error."""
    results: list[SaveResult] = []
    first: BaseException | None = None
    for fut in futures:
        try:
            results.append(fut.wait())
        except BaseException as e:
            if first is None:
                first = e
                for other in futures:
                    other.cancel()
    if first is not None:
        raise first
    return results


@dataclass
class Commit:
    """One checkpoint's commit (see the module docstring); :meth:`run` it on every rank.

    `what` names the checkpoint in errors; `control` is the ranks' private group (None: one
    process); `publishes`: whether this rank runs `publish` and `retire`."""

    what: str
    futures: Sequence[SaveFuture]
    control: ControlGroup | None = None
    kept: str = "the previous checkpoint stays as it was"
    publishes: bool = True
    prepare: Callable[[], None] | None = None
    durable: Callable[[list[SaveResult]], None] | None = None
    publish: Callable[[], None] | None = None
    retire: Callable[[], None] | None = None
    abandon: Callable[[], None] | None = None

    def run(self) -> list[SaveResult]:
        """Waits, agrees, publishes, retires; returns this rank's saves' results.

        Raises:
            GroupSaveError: another rank failed (naming it, and what is `kept`).
            The first error of this rank's own part.
        """
        error: BaseException | None = None
        results: list[SaveResult] = []
        try:
            if self.prepare is not None:
                self.prepare()
        except BaseException as e:
            error = e
            for fut in self.futures:
                fut.cancel()
        try:
            results = wait_all(self.futures)
            if self.durable is not None and error is None:
                self.durable(results)
        except BaseException as e:
            error = error or e
        self._agree(f"make its files of {self.what} durable", error)
        try:
            if self.publishes and self.publish is not None:
                self.publish()
        except BaseException as e:
            error = e
        self._agree(f"publish {self.what}", error)
        if self.publishes and self.retire is not None:
            self.retire()
        return results

    def _agree(self, what: str, error: BaseException | None) -> None:
        try:
            agree(self.control, what, error, f"; {self.what} was not committed and {self.kept}")
        except BaseException:
            if self.abandon is not None:
                with contextlib.suppress(Exception):  # the commit's error is the one to raise
                    self.abandon()
            raise
