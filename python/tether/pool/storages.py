"""A torch tensor that crosses to a pool's workers with a DataLoader's objects: its storage
moves to shared memory as with torch's own pickling (once; the workers read the parent's
very memory, and a parent that writes to it needs no new send), but each worker maps it
*copy-on-write*, as a fork would give it: what a worker writes to its copy (a cache that
``__getitem__`` fills, through a view or ``.numpy()``) stays its own, never reaches the
parent or the other workers, and is undone before its next lease (the mapping is
registered with ``snapshot.pages``, which tells whether any of its pages was written).

Several tensors over one storage stay views of one storage in the worker: a storage is
mapped once per unpickling (``mapping``)."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import sys
import weakref
from multiprocessing.reduction import DupFd
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from .recycle_page import Libc
from .snapshot import pages

__all__ = ["mapping", "overrides"]

#: The mapping of this module's reductions (the same dict each time: see ``common.pickling.dump``).
_overrides: Dict[Any, Any] = {}
#: The storages this unpickling mapped, by their memfd's ``(inode, device)``.
_mapped: Optional[Dict[Tuple[int, int], Any]] = None


def overrides() -> Optional[Dict[Any, Any]]:
    """The reductions that stand in for the usual ones in what a pool's workers receive for
    a DataLoader: torch's storage, mapped copy-on-write in the worker (None while torch is
    not loaded: nothing then to stand in for)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if not _overrides:
        _overrides[torch.UntypedStorage] = _reduce
    return _overrides


def _reduce(storage: Any) -> Tuple[Callable[..., Any], Tuple[Any, ...]]:
    """torch's reduction of a storage, but for a CPU storage, which the worker maps
    copy-on-write."""
    from torch.multiprocessing import get_sharing_strategy
    from torch.multiprocessing.reductions import reduce_storage

    if storage.device.type != "cpu" or storage.nbytes() == 0:
        return reduce_storage(storage)
    if get_sharing_strategy() == "file_system":
        return reduce_storage(storage)
    fd, size = storage._share_fd_cpu_()
    return _rebuild, (DupFd(fd), size)


@contextlib.contextmanager
def mapping() -> Iterator[None]:
    """While an unpickling runs: each storage is mapped once."""
    global _mapped
    previous, _mapped = _mapped, {}
    try:
        yield
    finally:
        _mapped = previous


def _rebuild(fd_ref: Any, size: int) -> Any:
    """A storage of ``size`` bytes over a copy-on-write mapping of the memfd that arrived."""
    import torch

    fd = fd_ref.detach()
    try:
        stat = os.fstat(fd)
        key = (stat.st_ino, stat.st_dev)
        if _mapped is not None and key in _mapped:
            return _mapped[key]
        memory = _map_private(fd, size)
    finally:
        os.close(fd)
    pages.register_private(memory)
    storage = torch.frombuffer(memory, dtype=torch.uint8).untyped_storage()
    if _mapped is not None:
        _mapped[key] = storage
    return storage


def _map_private(fd: int, size: int) -> Any:
    """A private, writable mapping of ``size`` bytes of ``fd``, as a ctypes array that unmaps
    it when it goes. (``mmap.mmap`` would keep a duplicate of the fd for as long: one per
    storage, and a dataset of many tensors would run out of fds.)"""
    address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
    if address in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map a tensor's storage of {size} bytes: {os.strerror(err)}")
    memory = (ctypes.c_char * size).from_address(address)
    weakref.finalize(memory, _libc.munmap, address, size)
    return memory


_libc = Libc()
_MAP_FAILED = ctypes.c_void_p(-1).value
