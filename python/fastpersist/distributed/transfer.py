"""Moving the files of a rank's share between ranks over the group's gloo control group.

Used by a save with partner copies: each share's files go to its partners, who write them
into their own node's step directory. The bytes travel in pieces of whole chunks (:data:`PIECE_BYTES`),
round by round: in round k every sender posts its k-th piece to each receiver and every
receiver posts its receives; while they travel, round k-1's arrivals are checked and written
and round k+1's pieces are read (point-to-point operations of gloo, each bounded by
the control group's timeout, so a dead peer fails the round instead of hanging it).

A data file's pieces are read back from the sender's copy with each chunk's crc32c checked (so
a damaged source is never propagated) and checked again on arrival before they are written.

Example:
    >>> piece_spans(10 << 20, 4 << 20, piece_bytes=8 << 20)
    [(0, 8388608), (8388608, 2097152)]
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import fastpersist._core as _core

from ..engine import PartFile, read_file_range
from ..errors import ChecksumMismatchError
from ..format.layout import MANIFEST_NAME
from ..format.manifest import parse

__all__ = ["PIECE_BYTES", "ShareFile", "Transfer", "piece_spans", "send_and_receive"]

#: Bytes of one piece on the wire (a multiple of the chunk size is taken): small enough that
#: reading, sending and writing the pieces of one share overlap, two rounds in flight.
PIECE_BYTES = 16 << 20


def piece_spans(len_bytes: int, chunk_bytes: int, piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int]]:
    """``(offset, length)`` of the pieces of a file of `len_bytes`, each whole chunks."""
    step = max(chunk_bytes, piece_bytes // chunk_bytes * chunk_bytes)
    return [(a, min(step, len_bytes - a)) for a in range(0, len_bytes, step)] or [(0, 0)]


@dataclass(frozen=True)
class ShareFile:
    """One file of a share: its name relative to the step directory, its size and chunk checksums
    (empty for a manifest, which carries its own seal)."""

    name: str
    len_bytes: int
    chunk_crc32c: list[int] = field(default_factory=list)

    @property
    def is_manifest(self) -> bool:
        return not self.chunk_crc32c and os.path.basename(self.name) == MANIFEST_NAME


@dataclass(frozen=True)
class Transfer:
    """One share's files going from `src` (reading under `src_dir`) to `dst` (writing under `dst_dir`)."""

    src: int
    dst: int
    files: list[ShareFile]


def _read_piece(path: str, f: ShareFile, offset: int, length: int, chunk_bytes: int, out: torch.Tensor) -> None:
    if length == 0:
        return
    if f.is_manifest or not f.chunk_crc32c:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read(length)
        if len(data) != length:
            raise OSError(f"{path}: short read ({len(data)} of {length} bytes at {offset})")
        out[:length].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return
    read_file_range(path, f.len_bytes, offset, length, f.chunk_crc32c, out.numpy(), chunk_bytes)


class _Receiving:
    """Writes one incoming file through the engine as its pieces arrive, each chunk checked
    against the sender's checksums (a manifest: its seal, once whole)."""

    def __init__(self, path: str, f: ShareFile, chunk_bytes: int, durable: bool) -> None:
        self.path, self.file = path, f
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.out = PartFile(path, f.len_bytes, f.chunk_crc32c, chunk_bytes, durable=durable)
        self.received = bytearray() if f.is_manifest else None

    def write(self, offset: int, data: torch.Tensor) -> None:
        if offset != self.out.written_bytes:
            raise RuntimeError(f"{self.path}: a piece at {offset} arrived after {self.out.written_bytes} bytes")
        view = data.numpy()
        try:
            self.out.append(view)
        except ChecksumMismatchError as e:
            e.add_note(f"the copy received of {self.file.name} differs from what its sender recorded; it is not kept")
            raise
        if self.received is not None:
            self.received += view.data

    def close(self) -> None:
        if self.received is not None:
            try:
                parse(bytes(self.received), where=self.path)  # its seal: a damaged manifest is not kept
            except BaseException:
                self.out.discard()
                raise
        self.out.finish()


def _steps(t: Transfer, chunk_bytes: int) -> list[tuple[ShareFile, int, int]]:
    return [(f, off, n) for f in t.files for off, n in piece_spans(f.len_bytes, chunk_bytes)]


class _Rounds:
    """This rank's side of the transfers, round by round, two rounds in flight: while round k's
    pieces travel, round k-1's arrivals are checked and written and round k+1's pieces are read."""

    def __init__(self, pg: Any, rank: int, transfers: list[Transfer], chunk_bytes: int, durable: bool) -> None:
        self.pg, self.rank, self.chunk_bytes, self.durable = pg, rank, chunk_bytes, durable
        self.plans = [(t, _steps(t, chunk_bytes)) for t in transfers if rank in (t.src, t.dst) and t.src != t.dst]
        self.count = max((len(steps) for _, steps in self.plans), default=0)
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}
        self.receiving: dict[tuple[int, str], _Receiving] = {}
        self.written: list[str] = []

    def _buffer(self, i: int, k: int) -> torch.Tensor:
        key = (i, k % 2)
        if key not in self.buffers:
            size = max(_core.DIRECT_ALIGN_BYTES, max(n for _, _, n in self.plans[i][1]))
            self.buffers[key] = torch.frombuffer(_core.PagedBuffer(size), dtype=torch.uint8)
        return self.buffers[key]

    def read(self, k: int, src_dir: str) -> None:
        """Reads this rank's outgoing pieces of round `k` into that round's buffers."""
        for i, (t, steps) in enumerate(self.plans):
            if t.src == self.rank and k < len(steps):
                f, offset, length = steps[k]
                _read_piece(os.path.join(src_dir, f.name), f, offset, length, self.chunk_bytes, self._buffer(i, k))

    def post(self, k: int) -> tuple[list[Any], list[tuple[Transfer, ShareFile, int, torch.Tensor]]]:
        """Starts round `k`'s sends and receives; returns their works and the arrivals to expect."""
        works, arrivals = [], []
        for i, (t, steps) in enumerate(self.plans):
            if k >= len(steps):
                continue
            f, offset, length = steps[k]
            piece = self._buffer(i, k)[:length]
            if t.src == self.rank:
                works.append(dist.isend(piece, group=self.pg, group_dst=t.dst))
            else:
                works.append(dist.irecv(piece, group=self.pg, group_src=t.src))
                arrivals.append((t, f, offset, piece))
        return works, arrivals

    def finish(
        self,
        posted: tuple[list[Any], list[tuple[Transfer, ShareFile, int, torch.Tensor]]],
        dst_dir: str,
        timeout: timedelta,
    ) -> None:
        """Waits for a round's works, then checks and writes its arrivals."""
        works, arrivals = posted
        for w in works:
            if w is not None:
                w.wait(timeout)
        for t, f, offset, piece in arrivals:
            key = (t.src, f.name)
            if key not in self.receiving:
                path = os.path.join(dst_dir, f.name)
                self.receiving[key] = _Receiving(path, f, self.chunk_bytes, self.durable)
                self.written.append(path)
            self.receiving[key].write(offset, piece)
            if offset + piece.numel() >= f.len_bytes:
                self.receiving.pop(key).close()


def send_and_receive(
    pg: Any,
    rank: int,
    transfers: list[Transfer],
    *,
    src_dir: str,
    dst_dir: str,
    chunk_bytes: int,
    timeout_s: float,
    durable: bool,
) -> list[str]:
    """Runs this rank's side of `transfers` (every rank passes the same list); returns the paths
    it wrote. Files are read from `src_dir` and written under `dst_dir` by their relative names.
    Raises on a failed read, a checksum mismatch on arrival, or a peer that stops answering."""
    timeout = timedelta(seconds=timeout_s)
    rounds = _Rounds(pg, rank, transfers, chunk_bytes, durable)
    previous: Any = None
    posted: Any = None
    try:
        if rounds.count:
            rounds.read(0, src_dir)
        for k in range(rounds.count):
            posted = rounds.post(k)
            if previous is not None:
                rounds.finish(previous, dst_dir, timeout)
            if k + 1 < rounds.count:
                rounds.read(k + 1, src_dir)  # overlaps round k on the wire
            previous = posted
        if previous is not None:
            rounds.finish(previous, dst_dir, timeout)
    except BaseException as e:
        # Pending works hold the group open: dropped, so that a failed collective that follows can
        # close it and the peers see it close (fastpersist.distributed.control).
        previous = posted = None
        if e.__traceback__ is not None and e.__traceback__.tb_next is not None:
            traceback.clear_frames(e.__traceback__.tb_next)
        raise
    finally:
        for r in rounds.receiving.values():
            r.out.discard()  # an unfinished copy is not kept
    return rounds.written
