"""The manifest's seal: a SHA-256 of its own bytes, its last JSON member (docs/format.md, "The seal").

Example:
    >>> unseal(seal(b'{"a":1}'), "m")
    (b'{"a":1}', True)
"""

from __future__ import annotations

import hashlib
import re

from ..errors import CorruptCheckpointError

__all__ = ["SEAL_FIELD", "seal", "unseal"]

#: The seal is the last member of the manifest's JSON object, byte for byte.
SEAL_FIELD = "manifest_sha256"
_SEAL_TAIL = re.compile(rb',"' + SEAL_FIELD.encode() + rb'":"([0-9a-f]{64})"\}\n?\Z')


def seal(body: bytes) -> bytes:
    """Appends ``"manifest_sha256": sha256(body)`` as the last member of the JSON object `body`.

    The digest covers the exact bytes of the object as written without that member, so
    checking it needs no re-serialisation: strip the member, restore the closing brace, hash.
    The result is still plain JSON that any tool reads.

    Example:
        >>> seal(b'{"a":1}')[:25]
        b'{"a":1,"manifest_sha256":'
    """
    if not (body.startswith(b"{") and body.endswith(b"}")) or body == b"{}":
        raise ValueError("seal() needs a non-empty JSON object")
    digest = hashlib.sha256(body).hexdigest().encode()
    return body[:-1] + b',"' + SEAL_FIELD.encode() + b'":"' + digest + b'"}'


def unseal(raw: bytes, where: str) -> tuple[bytes, bool]:
    """Checks the seal of manifest bytes; returns ``(body, sealed)``.

    A manifest without a seal is returned as is with ``sealed=False``; :func:`parse` then
    accepts it only as format 1.0 (written before the seal existed).

    Raises:
        CorruptCheckpointError: the seal is present and does not match the content.
    """
    match = _SEAL_TAIL.search(raw)
    if match is None:
        return raw, False
    body = raw[: match.start()] + b"}"
    found = hashlib.sha256(body).hexdigest()
    if found != match.group(1).decode():
        raise CorruptCheckpointError(
            f"{where}: the manifest's content does not match its {SEAL_FIELD} seal (expected "
            f"{match.group(1).decode()[:16]}..., found {found[:16]}...): the file was damaged or edited after "
            "the save; nothing in it is used"
        )
    return body, True
