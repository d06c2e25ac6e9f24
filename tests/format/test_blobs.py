"""Blob: what each attribute holds (the copier factory of a device-resident blob, its source tensor)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from fastpersist.format.flatten import flatten
from fastpersist.gpu import copiers as device


def test_a_device_resident_blob_holds_the_factory_of_its_copier() -> None:
    def factory(dev: torch.device) -> Any:
        raise AssertionError("flatten only records the factory; the save calls it")

    t = torch.ones(4)
    with device.use_copier(lambda x: x is t, factory):
        blob = flatten({"t": t}, copiers=device.DEVICE_COPIERS).blobs[0]
        assert flatten({"t": t}).blobs[0].device_copier is None  # a copier is the save's choice
    assert blob.device_copier is factory
    assert blob.source_tensor is t
    with pytest.raises(RuntimeError, match="its copier stages it"):
        _ = blob.data


def test_a_host_blob_has_no_copier_and_its_bytes_view_the_tensor() -> None:
    t = torch.arange(3, dtype=torch.int32)
    blob = flatten({"t": t}).blobs[0]
    assert blob.device_copier is None
    assert blob.data.view(np.int32).tolist() == [0, 1, 2]


def test_only_a_tensor_blob_has_a_source_tensor() -> None:
    blob = flatten({"a": np.zeros(3, np.float32)}).blobs[0]
    with pytest.raises(TypeError, match="ndarray, not a tensor"):
        _ = blob.source_tensor
