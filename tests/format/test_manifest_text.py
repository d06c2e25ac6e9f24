"""A manifest built from the members serialised ahead (StreamText) is the JSON of one dict, sealed."""

from __future__ import annotations

import json

from fastpersist.format.manifest import FileEntry, build, stream_text
from fastpersist.format.seal import seal


def _doc_bytes(manifest: bytes) -> bytes:
    """The manifest re-serialised as one dict, in its own member order, then sealed."""
    doc = json.loads(manifest)
    del doc["manifest_sha256"]
    return seal(json.dumps(doc, allow_nan=False, separators=(",", ":")).encode())


def test_stream_text_gives_the_bytes_of_one_dict() -> None:
    tensors = [{"key_path": "state.w", "dtype": "float32", "shape": [2, 3]}, {"key_path": 'state["é\\n"]'}]
    tree = {"spec_version": 1, "root": {"t": "dict", "k": ["w", "é\n"], "v": [{"t": "tensor", "i": 0}, 1.5]}}
    files = [
        FileEntry(name="data-w0-s0.bin", stripe=None, writer=0, stream_offset_bytes=0, len_bytes=128, chunk_crc32c=[7])
    ]
    common = {"checkpoint_id": "ab" * 16, "chunk_bytes": 1 << 20, "checksum": "crc32c", "total_bytes": 128}
    ahead = build(
        **common, files=files, stripes=[], stream=stream_text([0, 64], [24, 8], tensors, tree), extra={"a": [1]}
    )
    direct = build(
        **common, files=files, stripes=[], blobs=[(0, 24), (64, 8)], tensors=tensors, tree=tree, extra={"a": [1]}
    )
    assert json.loads(ahead)["created"] and _doc_bytes(ahead) == ahead
    assert json.loads(ahead)["blobs"] == [{"offset_bytes": 0, "len_bytes": 24}, {"offset_bytes": 64, "len_bytes": 8}]
    assert list(json.loads(ahead)) == list(json.loads(direct))


def test_a_sharded_top_manifest_keeps_shards_after_extra() -> None:
    m = build(
        checkpoint_id="cd" * 16,
        chunk_bytes=1 << 20,
        checksum="crc32c",
        total_bytes=0,
        files=[],
        stripes=[],
        blobs=[],
        tensors=[],
        tree={"spec_version": 1, "root": None},
        shards=["shard-00000", "shard-00001"],
    )
    keys = list(json.loads(m))
    assert keys[-3:] == ["extra", "shards", "manifest_sha256"] and _doc_bytes(m) == m
