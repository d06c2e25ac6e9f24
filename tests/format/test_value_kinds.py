"""Each value kind and each stride / storage-offset / memory-format case round-trips through fp.save / fp.load."""

from pathlib import Path

import torch

import fastpersist as fp


def test_value_kinds_and_geometry_round_trip(tmp_path: Path) -> None:
    base = torch.arange(48, dtype=torch.float32)
    p = torch.nn.Parameter(torch.ones(3))
    p.foo = "foo"
    p.n = 3
    state = {
        "t": base.reshape(6, 8).t(),
        "off": base.as_strided((3, 2), (4, 1), 2),
        "cl": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "size1": torch.zeros(3, 1).t(),
        "exp": torch.arange(3.0).expand(4, 3),
        "c32": torch.randn(4, 6, dtype=torch.complex32)[:, ::2]
        if False
        else torch.zeros(4, 6, dtype=torch.complex32)[:, ::2],
        "conj": torch.randn(4, 6, dtype=torch.complex64).t().conj(),
        "coo": torch.eye(3).to_sparse(),
        "csr": torch.eye(3).to_sparse_csr(),
        "csc": torch.eye(4).to_sparse_csc(),
        "bsr": torch.eye(4).to_sparse_bsr((2, 2)),
        "bsc": torch.eye(4).to_sparse_bsc((2, 2)),
        "uncoal": torch.sparse_coo_tensor([[0, 0], [1, 1]], [1.0, 2.0], (2, 2)),
        "set": {1, "a", (2, 3)},
        "fs": frozenset({4.5}),
        "ba": bytearray(b"xy"),
        "bigba": bytearray(b"z" * 10000),
        "p": p,
        "meta": torch.empty(3, 4, device="meta").t(),
    }
    fp.save(state, str(tmp_path / "ck"))
    back = fp.load(str(tmp_path / "ck"))
    for k, v in state.items():
        b = back[k]
        if isinstance(v, torch.Tensor):
            assert type(b) is type(v), k
            assert b.layout == v.layout and b.dtype == v.dtype and b.shape == v.shape, k
            if v.layout == torch.strided:
                assert b.stride() == v.stride(), (k, b.stride(), v.stride())
                if not v.is_conj():
                    assert b.storage_offset() == v.storage_offset(), (k, b.storage_offset(), v.storage_offset())
                if not v.is_meta:
                    assert torch.equal(
                        b.resolve_conj().contiguous().view(-1).view(torch.uint8),
                        v.resolve_conj().contiguous().view(-1).view(torch.uint8),
                    ), k
                else:
                    assert b.is_meta
            else:
                assert torch.equal(b.to_dense(), v.to_dense()), k
            assert b.__dict__ == v.__dict__, k
        else:
            assert b == v and type(b) is type(v), k
