"""Batch storages that go back to the leased worker that made them, once nothing reads them.

A fresh storage for each batch is most of a pool worker's work with big batches: a memfd
whose pages are allocated and zeroed, mapped, then unmapped and freed when the batch is
dropped (for 32 x 3x224x224 float32, about 60% of the worker's CPU, against about 30% to
make the items and stack them). So a leased worker keeps the storages of at least
``MIN_SIZE`` bytes it sends (``SLOTS`` of them at most), and the process that receives one
tells the worker when nothing holds it any more: the worker's next storage of that size is
that one, its pages already allocated and mapped. The worker never waits for one: when
none of the size is free, it makes a new storage, as it would without this module.

How the worker learns it: each worker has a *release page*, a memfd page of 64-bit words
(one per slot) whose fd travels with every storage it sends, with the storage's slot and a
*generation*, a number the page never used before. The receiving process rebuilds the
storage as torch does, maps the page (once, however many storages of that worker it holds,
and it keeps the last few pages it no longer needs mapped) and follows the storage with
torch's weak reference; once the storage is gone (every tensor and view of it, its mapping
unmapped), it writes the generation into the slot. It looks when it receives the next
storage, and when it leases a worker (there is no thread and no timer: a worker needs a
storage back only while it sends storages). The worker takes a storage back only when its
slot holds the generation it was sent with and nothing in the worker refers to it but this
module.

A storage that something may still read is never reused:

- sent a second time before it came back (a second message, another receiver): the worker
  forgets it;
- sent on by the receiver (a ``torch.multiprocessing`` queue, a pipe, a tether queue:
  anything pickled with ``ForkingPickler``), or held by the receiver when it forks (the
  child has the mapping): the receiver stops following it, and its slot never says it is
  free;
- a receiver that holds more than ``FOLLOWED`` of them stops following the oldest;
- a worker that forks forgets the storages referred to outside this module (the child
  may use them), and the child forgets them all;
- what a worker keeps when its lease ends, it keeps for its next lease only until it is
  idle or runs an executor task (``drop``; the memory goes when the receiver lets go of it
  too); a worker that dies takes its storages and its page with it.

A storage taken back holds the previous batch's bytes, not zeros: torch's callers of
``UntypedStorage._new_shared`` (collate, the checkpoint stager) write all of it."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

from .recycle_page import PAGE, SLOTS, Mapped, Page, libc

__all__ = ["begin", "drop", "end", "keep", "rebuild", "release_gone", "sending", "take", "unfollow"]

#: Storages smaller than this are made afresh each time.
MIN_SIZE = 1 << 16
#: How many storages a receiving process follows at most.
FOLLOWED = 64


# -- in the worker --------------------------------------------------------------------------


class _Kept:
    """A storage the worker keeps: its slot, and the generation it was last sent with (0
    while it is in the worker's hands)."""

    __slots__ = ("storage", "size", "slot", "generation")

    def __init__(self, storage: Any, size: int, slot: int) -> None:
        self.storage = storage
        self.size = size
        self.slot = slot
        self.generation = 0


_lock = threading.Lock()
_active = False
_page: Optional[Page] = None
_slots: List[Optional[_Kept]] = [None] * SLOTS
#: The kept storages by address (what a reduction knows of a storage).
_by_address: Dict[int, _Kept] = {}


def begin() -> None:
    """A leased process starts: from now on, storages are kept, and those kept from the
    lease before are used again once they came back."""
    global _active
    _active = True


def end() -> None:
    """The leased process ended: no storage is kept or taken until the next one begins.
    Those kept stay for the next lease (its first batches need not wait for new ones)
    until ``drop`` (the worker is idle)."""
    global _active
    _active = False


def drop() -> None:
    """Drops every kept storage (the worker is idle: its batches' memory goes, once their
    receivers let go of them too)."""
    if not _by_address:
        return  # nothing kept (an executor's worker asks before every batch of tasks)
    with _lock:
        _forget_all()


def _forget_all() -> None:
    for index in range(SLOTS):
        _slots[index] = None
    _by_address.clear()


def _forget(kept: _Kept) -> None:
    if _slots[kept.slot] is kept:
        _slots[kept.slot] = None
    _by_address.pop(kept.storage.data_ptr(), None)


def _references(kept: _Kept) -> int:
    return sys.getrefcount(kept.storage)


#: What ``_references`` says of an object that only a ``_Kept`` refers to.
_ONLY_KEPT = _references(_Kept(object(), 0, 0))


def _unreferenced(kept: _Kept) -> bool:
    """Whether nothing in this process refers to the storage but ``kept``: no tensor (the
    storage's use count is the Python object's own) and no other Python reference."""
    torch = sys.modules["torch"]
    return torch._C._storage_Use_Count(kept.storage._cdata) == 1 and _references(kept) == _ONLY_KEPT


def _free(kept: _Kept) -> bool:
    """Whether ``kept`` came back: sent, released by its receiver, unreferenced here."""
    return (
        _page is not None
        and kept.generation != 0
        and _page.words[kept.slot] == kept.generation
        and _unreferenced(kept)
    )


def take(cls: Any, size: int) -> Optional[Any]:
    """A kept storage of ``cls`` and ``size`` bytes that came back, or None."""
    if not _active or size < MIN_SIZE:
        return None
    with _lock:
        for kept in _slots:
            if kept is not None and kept.size == size and type(kept.storage) is cls and _free(kept):
                kept.generation = 0
                return kept.storage
    return None


def keep(storage: Any, size: int) -> None:
    """Keeps a new storage of ``size`` bytes, in a free slot, or else in place of one that
    came back, or else of the one sent longest ago. Those of other sizes that came back
    go: batches whose size changes all the time (padded to their longest item) must not
    leave the worker holding a storage of every size."""
    if not _active or size < MIN_SIZE:
        return
    with _lock:
        for kept in _slots:
            if kept is not None and kept.size != size and _free(kept):
                _forget(kept)
        slot = _slot_for_new()
        kept = _Kept(storage, size, slot)
        _slots[slot] = kept
        _by_address[storage.data_ptr()] = kept


def _slot_for_new() -> int:
    victim: Optional[_Kept] = None
    for index, kept in enumerate(_slots):
        if kept is None:
            return index
        if _free(kept):
            victim = kept
            break
        # Sent longest ago: the smallest generation (one not sent yet goes last).
        if victim is None or (kept.generation or 1 << 64) < (victim.generation or 1 << 64):
            victim = kept
    assert victim is not None
    _forget(victim)
    return victim.slot


def sending(storage: Any) -> Optional[Tuple[int, int, int]]:
    """A storage is being pickled: ``(release page fd, slot, generation)`` when it is a
    kept storage sent for the first time since it was taken, else None (a kept storage
    sent again is forgotten: its receivers could not tell the worker together)."""
    if not _by_address:
        return None
    global _page
    with _lock:
        kept = _by_address.get(storage.data_ptr())
        if kept is None:
            return None
        if kept.generation != 0:
            _forget(kept)
            return None
        if _page is None:
            _page = Page()
        kept.generation = _page.generation
        _page.generation += 1
        return _page.fd, kept.slot, kept.generation


def forget(storage: Any) -> None:
    """The storage was sent in a way that cannot come back: the worker forgets it."""
    with _lock:
        kept = _by_address.get(storage.data_ptr())
        if kept is not None:
            _forget(kept)


def _before_fork() -> None:
    _lock.acquire()
    _follow_lock.acquire()
    # The child may use what is referred to outside this module: never reuse it here.
    for kept in list(_by_address.values()):
        if not _unreferenced(kept):
            _forget(kept)
    # Neither may what this process received and still holds be reused by its worker.
    for key in list(_followed):
        _stop_following(key)


def _after_fork_in_parent() -> None:
    _follow_lock.release()
    _lock.release()


def _after_fork_in_child() -> None:
    global _lock, _follow_lock, _page, _active
    _lock, _follow_lock = threading.Lock(), threading.Lock()
    _active = False
    _forget_all()
    if _page is not None:
        _page.close()
        _page = None
    for page in _pages.values():
        libc().munmap(page.address, PAGE)
    _pages.clear()
    _idle.clear()


# -- in the receiving process ---------------------------------------------------------------


class _Followed:
    __slots__ = ("ref", "page", "slot", "generation")

    def __init__(self, ref: Any, page: Mapped, slot: int, generation: int) -> None:
        self.ref = ref
        self.page = page
        self.slot = slot
        self.generation = generation


_follow_lock = threading.Lock()
#: The storages followed, by address, oldest first.
_followed: Dict[int, _Followed] = {}
_pages: Dict[Tuple[int, int], Mapped] = {}
#: Pages no storage follows now, oldest first: they stay mapped (at most ``IDLE_PAGES``),
#: so that the next loader's first batch from the same worker finds its page mapped.
_idle: Dict[Tuple[int, int], Mapped] = {}
IDLE_PAGES = 8
_receiving = False


def rebuild(cls: Any, df: Any, size: int, page_df: Any, slot: int, generation: int) -> Any:
    """Unpickles a kept storage: torch's ``rebuild_storage_fd``, then the storage is followed
    so that its worker learns when it is gone."""
    from torch.multiprocessing import reductions

    storage = reductions.rebuild_storage_fd(cls, df, size)
    page_fd = page_df.detach()
    try:
        stat = os.fstat(page_fd)
        key = (stat.st_ino, stat.st_dev)
        with _follow_lock:
            _start_receiving()
            page = _pages.get(key)
            if page is None:
                page = _pages[key] = Mapped(key, page_fd)
            _idle.pop(key, None)
            page.users += 1
            # First what is gone: a new mapping may take the address of one just unmapped.
            _release_gone()
            address = storage.data_ptr()
            if address in _followed:
                # This very storage, still held (torch's cache gave it again): it is not
                # free when one of the two goes.
                _stop_following(address)
                _unuse(page)
            else:
                ref = reductions.StorageWeakRef(storage)
                _followed[address] = _Followed(ref, page, slot, generation)
                if len(_followed) > FOLLOWED:
                    _stop_following(next(iter(_followed)))
    finally:
        os.close(page_fd)
    return storage


def release_gone() -> None:
    """Tells the workers of the followed storages that are gone, now (a process that
    leases a worker does it first: the storages of the batches it dropped are the worker's
    again for the lease's first batches)."""
    if not _followed:
        return
    with _follow_lock:
        _release_gone()


def _release_gone() -> None:
    """Tells the workers of the followed storages that are gone."""
    for address, followed in list(_followed.items()):
        if followed.ref.expired():
            followed.page.words[followed.slot] = followed.generation
            _stop_following(address)


def _stop_following(address: int) -> None:
    _unuse(_followed.pop(address).page)


def _unuse(page: Mapped) -> None:
    page.users -= 1
    if page.users == 0:
        _idle[page.key] = page
        if len(_idle) > IDLE_PAGES:
            oldest = _idle.pop(next(iter(_idle)))
            del _pages[oldest.key]
            libc().munmap(oldest.address, PAGE)


def unfollow(storage: Any) -> None:
    """The storage is being pickled (sent on): its worker never gets it back."""
    if not _followed:
        return
    with _follow_lock:
        if storage.data_ptr() in _followed:
            _stop_following(storage.data_ptr())


def _start_receiving() -> None:
    """Once per process that receives kept storages: storages it sends on are unfollowed."""
    global _receiving
    if _receiving:
        return
    _receiving = True
    from multiprocessing.reduction import ForkingPickler

    import torch

    from tether.common import pickling

    reducers = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    reduce_storage = reducers[torch.UntypedStorage]

    def reduce(storage: Any) -> Any:
        unfollow(storage)
        return reduce_storage(storage)

    pickling.register(torch.UntypedStorage, reduce)


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)
