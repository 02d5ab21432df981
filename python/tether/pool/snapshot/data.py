"""Tensors and numpy arrays in a snapshot (see ``kinds``): what proves that one
still pickles as it did.

- a torch tensor: its type, dtype, device, shape, strides, offset, ``requires_grad`` and
  its storage (by identity; torch moves a storage to shared memory when it is first
  pickled, so the workers read the parent's very memory from then on). In a worker, a
  tensor over its copy-on-write map of such a storage (``storages``) is unchanged while
  no page of the map was written. A tensor on a
  storage not in shared memory, or on another storage, is compared by content when small
  (a copy is held; a write through ``.data`` or numpy bumps no version counter), and
  counts as changed when large. Other layouts (sparse, quantized, nested) cannot be
  proven;
- a numpy array (of numbers, not of objects): dtype, shape, order and content. Up to
  ``SMALL_ARRAY`` bytes, the content is compared with a copy; a larger array must be the
  same array over the same memory, none of it written since (``pages``: the kernel
  tells, in a time that does not grow with the array), else it is sent again."""

from __future__ import annotations

import ctypes
import sys
from typing import Any, Callable, Tuple

from . import pages
from .tokens import (
    ARRAY,
    PROVEN,
    TENSOR,
    UnprovableError,
    Walk,
    held,
    hold,
    reduced,
)

#: Numpy arrays up to this size are compared by content.
SMALL_ARRAY = 1 << 20
#: Tensors up to this size, on a storage other than the one seen before, by content.
SMALL_TENSOR = 1 << 16


def tensor(walk: Walk, tensor: Any, push: Callable[[Any], None]) -> None:
    torch = sys.modules["torch"]
    device = tensor.device
    if (
        tensor.layout is not torch.strided
        or tensor.is_quantized
        or getattr(tensor, "is_nested", False)
        or device.type == "meta"
        or (tensor.requires_grad and not tensor.is_leaf)
    ):
        raise UnprovableError(f"a tensor of layout {tensor.layout} cannot be proven unchanged")
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    facts = (
        type(tensor),
        tensor.dtype,
        device,
        tuple(tensor.shape),
        tensor.stride(),
        tensor.storage_offset(),
        tensor.requires_grad,
        nbytes,
    )
    shared = storage.is_shared()
    small = nbytes <= SMALL_TENSOR and device.type == "cpu"
    if walk.checking:
        # What ``same_tensor`` compares with: the storage by identity, the tensor when small.
        walk.emit((TENSOR, facts, _Seen(storage._cdata, shared), tensor if small else None))
    else:
        content: Any = None
        if device.type == "cpu" and not shared and nbytes:
            # A worker's copy-on-write map of a shipment's storage (see ``storages``).
            low = storage.data_ptr()
            if pages.private_unwritten(low, low + nbytes):
                content = _private_proof(low, low + nbytes)
        if content is None and small:
            content = tensor.detach().clone()  # a copy of it, as it is now
        walk.emit((TENSOR, facts, _StorageRef(storage, shared), content))
    state = getattr(tensor, "__dict__", None)
    push(state if state else None)


class _Seen:
    """A storage as a check sees it: its identity, and whether it is in shared memory."""

    __slots__ = ("cdata", "shared")

    def __init__(self, cdata: int, shared: bool) -> None:
        self.cdata = cdata
        self.shared = shared


class _StorageRef:
    """A storage by identity, without keeping it alive (torch's weak reference), and
    whether it was in shared memory when seen."""

    __slots__ = ("ref", "cdata", "shared")

    def __init__(self, storage: Any, shared: bool) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self.ref = StorageWeakRef(storage)
        self.cdata = storage._cdata
        self.shared = shared

    def same(self, other: Any) -> bool:
        """Whether ``other`` (a ``_Seen``) is this very storage, still alive."""
        return not self.ref.expired() and self.cdata == other.cdata


def same_tensor(old: Tuple[Any, ...], new: Tuple[Any, ...]) -> bool:
    """Whether a tensor still pickles as it did (see the module's documentation)."""
    _, facts, storage, content = old
    _, new_facts, new_storage, current = new
    if facts != new_facts:
        return False
    if storage.same(new_storage) and new_storage.shared:
        return True  # the workers map this very memory: what was written, they read
    if isinstance(content, _Private):
        return storage.same(new_storage) and content.unwritten()
    if content is None:
        return False
    torch = sys.modules["torch"]
    return current is not None and bool(torch.equal(content, current))


def array(walk: Walk, array: Any, push: Callable[[Any], None]) -> None:
    if array.dtype.hasobject:
        return reduced(walk, array, array.__reduce_ex__(5), push)
    fortran = array.flags.f_contiguous and not array.flags.c_contiguous
    facts = (array.dtype.str, array.dtype, array.shape, fortran)
    if array.nbytes <= SMALL_ARRAY:
        return walk.emit((ARRAY, facts, array.tobytes(order="A")))
    low, high = pages.bounds(array)
    if walk.checking:
        return walk.emit((PROVEN, facts, array, (low, high), None, b""))
    proof, edges = start_proof(low, high)
    if proof is None:
        raise UnprovableError(
            f"a numpy array of {array.nbytes} bytes outside anonymous memory, or where "
            "this kernel cannot prove memory unwritten, is not compared"
        )
    walk.emit((PROVEN, facts, hold(array), (low, high), proof, edges))


def start_proof(low: int, high: int) -> Tuple[Any, bytes]:
    """A proof that ``[low, high)`` is not written from now on (see ``pages``), and the
    bytes of the partial pages at its ends (compared by content)."""
    private = pages.private_unwritten(low, high)
    if private is not None:
        return _private_proof(low, high) if private else None, b""
    start = -(-low // pages.PAGE) * pages.PAGE
    end = max(start, high // pages.PAGE * pages.PAGE)
    protection = pages.protect(start, end)
    if protection is None:
        return None, b""
    return protection, _edges(low, high, start, end)


def _private_proof(low: int, high: int) -> Any:
    """A proof for ``[low, high)`` of a worker's private mapping of a shipment, whose pages
    are all still the memfd's: the page map itself, scanned for a page of the worker's own.
    (Not a write protection, as the parent's arrays have: protecting pages the worker never
    touched fills their page tables, and every check would then walk all of them; the page
    map's scan walks only what the worker read: 20 us for a batch of rows of a 512 MiB
    array where the protection's took 0.4 ms.)"""
    return _Private(low, high)


def _edges(low: int, high: int, start: int, end: int) -> bytes:
    return ctypes.string_at(low, start - low) + ctypes.string_at(end, high - end)


class _Private:
    """A range of a worker's private mapping of a shipment (see ``pages``)."""

    __slots__ = ("low", "high")

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high

    def unwritten(self) -> bool:
        return bool(pages.private_unwritten(self.low, self.high))


def same_array(old: Tuple[Any, ...], new: Tuple[Any, ...]) -> bool:
    return bool(old[1] == new[1] and old[2] == new[2])


def same_proven(old: Tuple[Any, ...], new: Tuple[Any, ...]) -> bool:
    """Whether a big array is the same array over the same memory, and no byte of it was
    written."""
    _, facts, ref, (low, high), proof, edges = old
    if not (facts == new[1] and held(ref) is new[2] and (low, high) == new[3]):
        return False
    return unwritten((low, high), proof, edges)


def unwritten(span: Tuple[int, int], proof: Any, edges: bytes) -> bool:
    """Whether no byte of ``span`` was written since ``start_proof`` gave ``proof`` and
    ``edges``."""
    if not proof.unwritten():
        return False
    if isinstance(proof, _Private) or not edges:
        return True
    return _edges(span[0], span[1], proof.start, proof.end) == edges
