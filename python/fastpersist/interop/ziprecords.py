"""Where the records of a zip archive lie and where each one's CRC-32 is recorded.

``torch.save`` writes an uncompressed zip archive. Every non-empty record has the "data
descriptor" flag (bit 3): its local header holds CRC 0, and the real CRC-32 sits in the
descriptor right after the record's bytes and in its central-directory entry. So both places
come after the bytes they sum, and a writer that streams the archive in order can fill them in
on the way (the engine's ``crc32_fields``). This module finds those places from the archive's
skeleton: its bytes are readable everywhere except inside the records of storages.

Example:
    >>> import io, struct, zlib, torch
    >>> buf = io.BytesIO()
    >>> torch.save({"w": torch.ones(2)}, buf)
    >>> data = buf.getvalue()
    >>> rec = zip_records(lambda at, n: data[at : at + n], len(data))[0]
    >>> rec.name, len(rec.crc_offsets)
    ('archive/data.pkl', 2)
    >>> body = data[rec.data_offset_bytes : rec.data_offset_bytes + rec.len_bytes]
    >>> [struct.unpack_from("<L", data, at)[0] == zlib.crc32(body) for at in rec.crc_offsets]
    [True, True]
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["ZipRecord", "zip_records"]

_EOCD = struct.Struct("<4s4H2LH")  # signature, disks, entries (here, total), cd size, cd offset, comment
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")
_CENTRAL = struct.Struct("<4s6H3L5H2L")
_LOCAL = struct.Struct("<4s5H3L2H")
_CRC_IN_CENTRAL = 16  # offset of the CRC-32 field in a central-directory entry
_CRC_IN_DESCRIPTOR = 4  # ... and in a data descriptor (after its signature)
_SAT32 = 0xFFFFFFFF

#: Reads `n` bytes of the archive at an offset (ValueError where they are not known).
ReadAt = Callable[[int, int], bytes]


class ZipRecord(NamedTuple):
    """One stored (uncompressed) record: its bytes and where its CRC-32 is recorded."""

    name: str
    data_offset_bytes: int
    len_bytes: int
    #: Offsets of the CRC-32 fields of this record: the data descriptor's, the central directory's.
    crc_offsets: tuple[int, ...]


def zip_records(read_at: ReadAt, total_bytes: int) -> list[ZipRecord]:
    """The archive's records in file order. Raises ValueError on anything but stored records
    whose CRCs all come after their bytes (what ``torch.save`` writes)."""
    cd_offset, cd_bytes, entries = _central_directory(read_at, total_bytes)
    cd = read_at(cd_offset, cd_bytes)
    records: list[ZipRecord] = []
    pos = 0
    for _ in range(entries):
        if pos + _CENTRAL.size > len(cd):
            raise ValueError(f"the central directory ends inside entry {len(records)}")
        sig, _made, _need, flags, method, _t, _d, _crc, csize, usize, n, e, c, _disk, _ia, _ea, header = (
            _CENTRAL.unpack_from(cd, pos)
        )
        if sig != b"PK\x01\x02":
            raise ValueError(f"no central-directory entry at byte {cd_offset + pos}")
        name = cd[pos + 46 : pos + 46 + n].decode("utf-8", "replace")
        if _SAT32 in (csize, usize, header):
            csize, header = _zip64_sizes(cd[pos + 46 + n : pos + 46 + n + e], csize, usize, header)
        if method != 0:
            raise ValueError(f"record {name!r} is compressed (method {method})")
        local = read_at(header, _LOCAL.size)
        if local[:4] != b"PK\x03\x04":
            raise ValueError(f"no local header for {name!r} at byte {header}")
        name_len, extra_len = _LOCAL.unpack(local)[9:11]
        data = header + _LOCAL.size + name_len + extra_len
        crcs = [cd_offset + pos + _CRC_IN_CENTRAL]
        if csize:
            if not flags & 0x08:
                raise ValueError(f"record {name!r} has no data descriptor (its CRC would precede its bytes)")
            if read_at(data + csize, 4) != b"PK\x07\x08":
                raise ValueError(f"no data descriptor after record {name!r} at byte {data + csize}")
            crcs.insert(0, data + csize + _CRC_IN_DESCRIPTOR)
        records.append(ZipRecord(name, data, csize, tuple(crcs)))
        pos += _CENTRAL.size + n + e + c
    return sorted(records, key=lambda r: r.data_offset_bytes)


def _central_directory(read_at: ReadAt, total_bytes: int) -> tuple[int, int, int]:
    """(offset, length, entry count) of the central directory, from the end records."""
    at = total_bytes - _EOCD.size
    if at < 0:
        raise ValueError(f"{total_bytes} bytes is too short for a zip archive")
    sig, _disk, _cd_disk, _here, entries, cd_bytes, cd_offset, comment = _EOCD.unpack(read_at(at, _EOCD.size))
    if sig != b"PK\x05\x06" or comment:
        raise ValueError("the archive does not end with an end-of-central-directory record")
    if _SAT32 in (cd_bytes, cd_offset) or entries == 0xFFFF:
        sig, _disk, z64_at, _disks = _ZIP64_LOCATOR.unpack(read_at(at - _ZIP64_LOCATOR.size, _ZIP64_LOCATOR.size))
        if sig != b"PK\x06\x07":
            raise ValueError("a zip64 archive without a zip64 end-of-central-directory locator")
        fields = _ZIP64_EOCD.unpack(read_at(z64_at, _ZIP64_EOCD.size))
        if fields[0] != b"PK\x06\x06":
            raise ValueError(f"no zip64 end-of-central-directory record at byte {z64_at}")
        entries, cd_bytes, cd_offset = fields[7], fields[8], fields[9]
    return cd_offset, cd_bytes, entries


def _zip64_sizes(extra: bytes, csize: int, usize: int, header: int) -> tuple[int, int]:
    """(compressed size, local header offset) with the zip64 extra field's values filled in."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<2H", extra, pos)
        if tag == 0x0001:
            values = iter(struct.unpack_from(f"<{size // 8}Q", extra, pos + 4))
            if usize == _SAT32:
                next(values)
            csize = next(values) if csize == _SAT32 else csize
            header = next(values) if header == _SAT32 else header
            return csize, header
        pos += 4 + size
    raise ValueError("a zip64 record without its zip64 extra field")
