"""Shared memory for the tensors a pool worker sends: memfds, never ``/dev/shm``.

torch puts a DataLoader worker's batches in shared memory (collate allocates them with
``storage._new_shared``, and a tensor put on a queue is moved there), through ``shm_open``,
that is in ``/dev/shm``: where that is small (64 MiB in a container, by default), loaders
of big batches fail. In a pool worker with torch loaded, ``install`` makes both paths
allocate memfds instead, which only the machine's memory limits; the receiving side maps a
storage from the fd as it always does (``UntypedStorage._new_shared_fd_cpu``). The pages
are allocated when the storage is made, so that running out of memory raises an error
that says how much was asked, not a SIGBUS later.

In a leased process, the storages of at least 64 KiB go back to the worker once their
receiver let go of them, and are reused (see ``recycle``).

A tensor a worker sends that is not in shared memory yet (an item of a loader without
batching, a view of a tensor the dataset made) moves into a memfd in place, once, as
torch's ``share_memory_()`` moves it into ``/dev/shm``: every later send of it or of another
view of its storage sends the same memory. A tensor the program itself moves with
``share_memory_()`` still goes through torch's own path."""

from __future__ import annotations

import os
import sys
from multiprocessing.reduction import DupFd, ForkingPickler
from typing import Any, Callable, Tuple

from tether.common import pickling

from . import recycle

__all__ = ["install", "memfd", "memfd_storage", "move_to_memfd"]

_installed = False


def memfd(who: str, what: str, size: int, sealing: bool = False) -> int:
    """A new memfd of ``size`` bytes whose pages are allocated now, so that running out of
    memory is a ``MemoryError`` that names ``who`` asked, for ``what`` and how much, not a
    SIGBUS when a page is first touched."""
    flags = os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealing else 0)
    fd = os.memfd_create(what[:200], flags)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        os.close(fd)
        raise MemoryError(
            f"{who} cannot allocate {size} bytes ({size / 2**20:.1f} MiB) of shared memory "
            f"(a memfd) for {what}: {exc.strerror}"
        ) from None
    return fd


def memfd_storage(cls: Any, size: int) -> Any:
    """A ``cls`` (torch's ``UntypedStorage``) of ``size`` bytes in a memfd: one that came
    back to this worker (see ``recycle``), or else a new one. An empty one has no memory to
    share (torch pickles it as empty): a plain empty storage (a batch of empty tensors)."""
    if size == 0:
        return cls(0)
    storage = recycle.take(cls, size)
    if storage is not None:
        return storage
    fd = memfd(f"tether.Pool worker (pid {os.getpid()})", "a tensor", size)
    try:
        storage = cls._new_shared_fd_cpu(fd, size)  # maps its own duplicate of the fd
    finally:
        os.close(fd)
    if size >= POPULATE:
        _populate(storage.data_ptr(), size)
    recycle.keep(storage, size)
    return storage


#: Storages at least this large get their page tables filled in one call.
POPULATE = 1 << 16
_MADV_POPULATE_WRITE = 23
_madvise: Any = None


def _populate(address: int, size: int) -> None:
    """Maps every page of a new storage at once (``MADV_POPULATE_WRITE``, Linux 5.14):
    a batch is written whole right after, and one call costs a third of what a write fault
    per page does. Where the kernel lacks it, the pages fault in as usual."""
    global _madvise
    if _madvise is None:
        import ctypes

        _madvise = ctypes.CDLL(None, use_errno=True).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _madvise(address, size, _MADV_POPULATE_WRITE)


def install() -> None:
    """In a pool worker, once torch is loaded: torch's shared CPU storages are memfds."""
    global _installed
    if _installed:
        return
    torch = sys.modules.get("torch")
    storage = None if torch is None else getattr(torch, "UntypedStorage", None)
    reductions = sys.modules.get("torch.multiprocessing.reductions")
    if storage is None or reductions is None:
        return
    _installed = True
    storage._new_using_fd_cpu = classmethod(memfd_storage)
    # The reduction registered now: torch's, or one that wraps it.
    registered = ForkingPickler._extra_reducers.get(  # type: ignore[attr-defined]
        storage, reductions.reduce_storage
    )
    pickling.register(storage, _worker_reducer(torch, registered, reductions.rebuild_storage_fd))


def _worker_reducer(
    torch: Any, reduce_storage: Callable[[Any], Tuple[Any, ...]], rebuild_fd: Callable[..., Any]
) -> Callable[[Any], Tuple[Any, ...]]:
    """torch's storage reduction, but a CPU storage not in shared memory yet moves into a
    memfd first, in place (torch would move it into ``/dev/shm``), and a storage this
    worker keeps travels with what its receiver needs to give it back
    (``recycle.rebuild``)."""

    def reduce(storage: Any) -> Tuple[Any, ...]:
        if (
            storage.device.type == "cpu"
            and not storage.is_shared()
            and storage.nbytes() > 0
            and torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
        ):
            move_to_memfd(storage)
        kept = recycle.sending(storage)
        reduced = reduce_storage(storage)
        if kept is None:
            return reduced
        rebuild, args = reduced
        if rebuild is not rebuild_fd:
            recycle.forget(storage)
            return reduced
        page_fd, slot, generation = kept
        return recycle.rebuild, (*args, DupFd(page_fd), slot, generation)

    return reduce


def move_to_memfd(storage: Any) -> None:
    """Moves a CPU storage into a new memfd in place, as ``share_memory_()`` moves one into
    ``/dev/shm``: every tensor and view of it reads the memfd from now on, so that sending
    it again, or another view of it, sends the same memory (one fd, mapped once by its
    receiver). Where torch cannot swap a storage's memory, torch's own move does it."""
    if not hasattr(storage, "_swap_data_ptr_"):
        storage.share_memory_()
        return
    size = storage.nbytes()
    fd = memfd(f"tether.Pool worker (pid {os.getpid()})", "a tensor", size)
    try:
        shared = type(storage)._new_shared_fd_cpu(fd, size)  # maps its own duplicate
    finally:
        os.close(fd)
    shared.copy_(storage)
    storage._swap_data_ptr_(shared)  # `shared` now holds the old memory, freed with it
