"""The checks of a :class:`~fastpersist.Checkpointer`'s remote-level arguments that hold with or
without a remote: a `remote` that names no place, and remote settings given without one (they
would be silently ignored). The settings' values are checked by the remote level itself
(:mod:`fastpersist.levels.remote_level`).

Example:
    >>> check_remote_arguments(None, None, 2, None)  # no remote, no remote settings: fine
    >>> check_remote_arguments(None, 0, 2, None)
    Traceback (most recent call last):
    ...
    ValueError: remote_every=0 applies to the remote level, but remote= is None: pass remote= too
"""

from __future__ import annotations

from ..arguments import given_path

__all__ = ["check_remote_arguments"]


def check_remote_arguments(
    remote: object, remote_every: object, remote_keep: object, remote_bytes_per_s: object
) -> None:
    """Refuses a `remote` that names no place, and remote settings given without a remote (they
    would be silently ignored); the settings' values are checked with the remote level."""
    if remote is not None:
        expected = "None (no remote level), a directory on a shared filesystem or an s3://bucket/prefix URL"
        given_path(remote, "remote", "Checkpointer", expected)
        return
    for name, value, default in (
        ("remote_every", remote_every, None),
        ("remote_keep", remote_keep, 2),
        ("remote_bytes_per_s", remote_bytes_per_s, None),
    ):
        if value != default or type(value) is not type(default):
            raise ValueError(f"{name}={value!r} applies to the remote level, but remote= is None: pass remote= too")
