"""``load``'s torch.load-style arguments: ``map_location`` in every form torch accepts, and
what ``weights_only`` / ``mmap`` mean for a format that never unpickles.

``map_location`` (as in ``torch.load``):

* ``None``: each tensor goes back to the device it was saved from;
* a ``str`` or ``torch.device``: every tensor goes there;
* a dict ``{saved location: target}`` (e.g. ``{"cuda:1": "cuda:0"}``); unlisted locations stay;
* a callable ``fn(storage, location)``, called once per storage with the CPU
  ``torch.UntypedStorage`` holding the bytes and the saved location string (``"cuda:0"``); it
  returns a storage (typed or untyped) on the target device, or ``None`` to keep the default.
  Returning a tensor is accepted too. Tensors that shared a storage share the mapped one.

``weights_only``: fastpersist's format holds only data (tensors, containers and plain
values); loading never unpickles, so every load is "weights only" whatever the value.
``mmap``: accepted for compatibility; the data is always read into memory with O_DIRECT and
verified against its checksums (a memory-mapped file could change under a verified tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..errors import FastPersistError
from ..format.quote import shown
from ..gpu.loaders import CudaLoader, loader_for

__all__ = ["MapLocation", "MappedStorages", "check_load_flags", "check_targets_exist", "map_tensor", "target_device"]

MapLocation = str | torch.device | Mapping[str, str | torch.device] | Callable[[torch.UntypedStorage, str], Any] | None
#: Mapped storages by the data pointer of their source storage (and the target device, for a
#: moved one), so that tensors which shared a storage share the mapped one.
MappedStorages = dict[Any, Any]


def check_load_flags(weights_only: bool | None, mmap: bool | None) -> None:
    """Validates ``weights_only`` / ``mmap`` (both accepted; see the module docstring)."""
    for name, value in (("weights_only", weights_only), ("mmap", mmap)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be None, True or False, not {type(value).__name__}")


def target_device(location: MapLocation, saved_device: str) -> torch.device | None:
    """Where `location` sends a tensor saved on `saved_device`; None for a callable (only the
    call can say).

    Example:
        >>> target_device({"cuda:1": "cuda:0"}, "cuda:1"), target_device(None, "cpu")
        (device(type='cuda', index=0), device(type='cpu'))
    """
    if location is None:
        target: str | torch.device = saved_device
    elif isinstance(location, (str, torch.device)):
        target = location
    elif isinstance(location, Mapping):
        target = location.get(saved_device, saved_device)
    elif callable(location):
        return None
    else:
        raise TypeError(
            "map_location must be None, a device, a dict or a callable(storage, location), "
            f"not {type(location).__name__}"
        )
    return torch.device(target)


def check_targets_exist(location: MapLocation, saved: Iterable[tuple[str, str]], where: str) -> None:
    """Refuses, before anything is read, a CUDA target this machine lacks (no CUDA, or an index
    past ``torch.cuda.device_count()``). `saved` holds ``(key path, saved device)`` of the
    tensors to be placed; `where` names the checkpoint. A callable `location` is not checked
    (only its calls can say where a storage goes).

    Raises:
        FastPersistError: naming the device, the first tensor bound for it and `location`.
    """
    checked: set[str] = set()
    for key_path, saved_device in saved:
        if saved_device in checked:
            continue
        checked.add(saved_device)
        target = target_device(location, saved_device)
        if target is None or target.type != "cuda" or loader_for(target) not in (None, CudaLoader):
            continue  # a loader installed for the device (use_loader) knows where it is
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count and (target.index is None or target.index < count):
            continue
        have = f"only {count} CUDA device(s) (cuda:0..cuda:{count - 1})" if count else "no CUDA device"
        raise FastPersistError(
            f"{where}: tensor {key_path!r} (saved on {saved_device}) would be loaded to {target} "
            f"(map_location={location!r}), but this machine has {have}; pass map_location='cpu', or a dict "
            f"such as {{'{saved_device}': 'cuda:0'}} naming a device that exists"
        )


def map_tensor(location: MapLocation, tensor: torch.Tensor, saved_device: str, cache: MappedStorages) -> torch.Tensor:
    """`tensor` (on the CPU, as read) moved where `location` says (see the module docstring).

    Raises:
        ValueError: the target device does not exist here (a checkpoint saved on a GPU loaded
            without ``map_location`` on a machine without that GPU).
    """
    if tensor.device.type == "meta":  # no data to move: torch.load keeps meta tensors whatever the target
        return tensor
    target = target_device(location, saved_device)
    if target is None:
        assert callable(location)
        return _call(location, tensor, saved_device, cache)
    if target == tensor.device:
        return tensor
    try:
        storage = _moved_storage(tensor.untyped_storage(), target, cache)
    except (RuntimeError, AssertionError) as e:  # torch asserts when it was built without CUDA
        raise ValueError(
            f"a tensor saved on {shown(saved_device)} cannot go to {target} here ({type(e).__name__}: "
            f"{shown(str(e), 160)}); pass map_location='cpu', a device this machine has, or a "
            "{saved: target} dict"
        ) from None
    with torch.no_grad():
        moved = torch.empty(0, dtype=tensor.dtype, device=target)
        moved.set_(storage, tensor.storage_offset(), tensor.shape, tensor.stride())
    return _like(tensor, moved)


def _moved_storage(storage: torch.UntypedStorage, target: torch.device, cache: MappedStorages) -> Any:
    """`storage` (one blob's bytes, as read) on `target`, moved once: the tensors viewing it keep
    their strides and offsets there, and their sharing."""
    key = (storage.data_ptr(), str(target))
    if key not in cache:
        raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        cache[key] = raw.to(target).untyped_storage()
    return cache[key]


def _like(source: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
    if isinstance(source, torch.nn.Parameter) and not isinstance(moved, torch.nn.Parameter):
        return torch.nn.Parameter(moved, requires_grad=source.requires_grad)
    if source.requires_grad and not moved.requires_grad and moved.is_leaf:
        moved.requires_grad_(True)
    return moved


def _call(fn: Callable[..., Any], tensor: torch.Tensor, saved_device: str, cache: MappedStorages) -> torch.Tensor:
    storage = tensor.untyped_storage()
    key = storage.data_ptr()
    if key not in cache:
        cache[key] = fn(storage, saved_device)
    result = cache[key]
    if result is None:
        return map_tensor(None, tensor, saved_device, cache)
    if isinstance(result, torch.Tensor):  # a callable that returned a tensor for the storage
        result = result.untyped_storage()
    if isinstance(result, torch.TypedStorage):
        result = result._untyped_storage
    if not isinstance(result, torch.UntypedStorage):
        raise TypeError(f"map_location returned {type(result).__name__}; expected a storage, a tensor or None")
    if result.data_ptr() == key and result.device == storage.device:
        return tensor
    if result.nbytes() < storage.nbytes():
        raise ValueError(f"map_location returned a storage of {result.nbytes()} bytes for one of {storage.nbytes()}")
    with torch.no_grad():
        moved = torch.empty(0, dtype=tensor.dtype, device=result.device)
        moved.set_(result, tensor.storage_offset(), tensor.shape, tensor.stride())
    return _like(tensor, moved)
