"""Proofs that a range of this process's memory was not written since a moment, without
reading it: how a big numpy array is proven unchanged (see ``kinds``) in a time
that does not grow with its size.

- In a pool worker, an array unpickled from a shipment's out-of-band buffers lies in a
  private (copy-on-write) mapping of a memfd (see ``shipment``): a page the worker wrote
  became a page of its own. ``/proc/self/pagemap`` tells, 8 bytes per page, whether each
  page is still the memfd's (``private_unwritten``).
- Anywhere else (the parent's arrays), the range is registered with a userfaultfd in
  asynchronous write-protect mode (Linux 6.7: the kernel lets every write through, and
  only clears the page's write protection), and ``PAGEMAP_SCAN`` tells whether any page
  of the range lost it (``Protection``). Anonymous memory only (a ``malloc``'d array); a
  file mapping, or a kernel or a sandbox without userfaultfd, gives no proof.

A range's pages are protected again only through ``protect``, which first records that
the range was written (``_dirty``), so that a proof taken earlier over the same pages is
not fooled by the fresh protection. Nothing here ever blocks a write."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import struct
import threading
import weakref
from typing import Any, Dict, Optional, Tuple

__all__ = ["Protection", "private_unwritten", "protect", "register_private"]

PAGE = mmap.PAGESIZE

# userfaultfd(2) and its ioctls (linux/userfaultfd.h), and PAGEMAP_SCAN (linux/fs.h).
_UFFD_USER_MODE_ONLY = 1
_SYSCALL = {"x86_64": 323, "aarch64": 282}
_FEATURES = (1 << 15) | (1 << 13)  # WP_ASYNC | WP_UNPOPULATED
_MODE_WP = 1 << 1


def _iowr(kind: int, number: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (kind << 8) | number


_UFFDIO_API = _iowr(0xAA, 0x3F, 24)
_UFFDIO_REGISTER = _iowr(0xAA, 0x00, 32)
_UFFDIO_UNREGISTER = (2 << 30) | (16 << 16) | (0xAA << 8) | 0x01
_UFFDIO_WRITEPROTECT = _iowr(0xAA, 0x06, 24)
_PAGEMAP_SCAN = _iowr(ord("f"), 16, 96)
_WPALLOWED, _WRITTEN = 1 << 0, 1 << 1


class _Faults:
    """This process's userfaultfd and ``/proc/self/pagemap`` (opened on first use); both
    None where they cannot be had."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = -1
        self.uffd: Optional[int] = None
        self.pagemap: Optional[int] = None
        #: Registered ranges: (start, end) -> users.
        self.ranges: Dict[Tuple[int, int], int] = {}
        #: The tick of the last write seen to each registered range, and the clock.
        self.dirty: Dict[Tuple[int, int], int] = {}
        self.tick = 0

    def open(self) -> bool:
        if self.pid != os.getpid():  # first use, or a forked child: its own
            self.pid, self.uffd, self.ranges, self.dirty = os.getpid(), None, {}, {}
            self.uffd = _userfaultfd()
            self.pagemap = _own_pagemap()
        return self.uffd is not None and self.pagemap is not None

    def close(self) -> None:
        if self.uffd is not None:
            os.close(self.uffd)
        if not _private:
            _forget_pagemap()
        self.pid, self.uffd, self.pagemap = -1, None, None


_pagemaps: Dict[int, int] = {}


def _forget_pagemap() -> None:
    fd = _pagemaps.pop(os.getpid(), None)
    if fd is not None:
        os.close(fd)


def _own_pagemap() -> Optional[int]:
    """This process's ``/proc/self/pagemap`` (an fd a forked child inherited describes its
    parent: each process opens its own)."""
    fd = _pagemaps.get(os.getpid())
    if fd is None:
        try:
            fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        _pagemaps.clear()  # a parent's, inherited: not ours to read (closed with the process)
        _pagemaps[os.getpid()] = fd
    return fd


def _userfaultfd() -> Optional[int]:
    number = _SYSCALL.get(os.uname().machine)
    if number is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    fd = int(libc.syscall(number, os.O_CLOEXEC | os.O_NONBLOCK | _UFFD_USER_MODE_ONLY))
    if fd < 0:
        return None
    api = bytearray(struct.pack("QQQ", 0xAA, _FEATURES, 0))
    try:
        fcntl.ioctl(fd, _UFFDIO_API, api)
    except OSError:
        os.close(fd)
        return None
    if struct.unpack("QQQ", api)[1] & _FEATURES != _FEATURES:
        os.close(fd)
        return None
    return fd


_faults = _Faults()


def _scan(start: int, end: int, inverted: int, anyof: int) -> bool:
    """Whether ``PAGEMAP_SCAN`` finds a page of ``[start, end)`` in one of the categories
    ``anyof`` (after flipping those of ``inverted``); True when the scan fails."""
    region = (ctypes.c_uint64 * 3)()
    vec = ctypes.addressof(region)
    arg = bytearray(struct.pack("12Q", 96, 0, start, end, 0, vec, 1, 1, inverted, 0, anyof, anyof))
    try:
        found = fcntl.ioctl(_faults.pagemap, _PAGEMAP_SCAN, arg)  # type: ignore[arg-type]
    except OSError:
        return True
    return bool(found) if isinstance(found, int) else True


def _written(start: int, end: int) -> bool:
    """Whether a page of a registered range was written since it was protected (or is
    not write-protectable at all)."""
    return _scan(start, end, _WPALLOWED, _WRITTEN | _WPALLOWED)


class Protection:
    """A write protection of ``[start, end)`` (page-aligned), taken at ``tick``."""

    __slots__ = ("start", "end", "tick", "__weakref__")

    def __init__(self, start: int, end: int, tick: int) -> None:
        self.start, self.end, self.tick = start, end, tick

    def unwritten(self) -> bool:
        """Whether no page of the range was written since the protection was taken."""
        with _faults.lock:
            if _faults.pid != os.getpid():
                return False
            if _written(self.start, self.end):
                _mark_dirty(self.start, self.end)
                return False
            return _faults.dirty.get((self.start, self.end), -1) < self.tick


def _mark_dirty(start: int, end: int) -> None:
    """Writes were seen in ``[start, end)``: every registered range over it was written."""
    for lo, hi in _faults.ranges:
        if lo < end and start < hi:
            _faults.dirty[(lo, hi)] = _faults.tick


def protect(start: int, end: int) -> Optional[Protection]:
    """Protects ``[start, end)`` (page-aligned) from now on, or None where it cannot be."""
    with _faults.lock:
        if end <= start or not _faults.open():
            return None
        key = (start, end)
        if key not in _faults.ranges and not _ioctl(_UFFDIO_REGISTER, start, end, _MODE_WP, 0):
            return None
        _faults.ranges[key] = _faults.ranges.get(key, 0) + 1
        _faults.tick += 1
        if _written(start, end):  # a proof taken before this one must not miss it
            _mark_dirty(start, end)
        _faults.tick += 1
        if not _ioctl(_UFFDIO_WRITEPROTECT, start, end, 1):
            _release(key)
            return None
        protection = Protection(start, end, _faults.tick)
        weakref.finalize(protection, _release_later, key, os.getpid())
        return protection


def _release_later(key: Tuple[int, int], pid: int) -> None:
    with _faults.lock:
        if _faults.pid == pid:
            _release(key)


def _release(key: Tuple[int, int]) -> None:
    users = _faults.ranges.get(key, 0) - 1
    if users > 0:
        _faults.ranges[key] = users
        return
    _faults.ranges.pop(key, None)
    _faults.dirty.pop(key, None)
    _ioctl(_UFFDIO_UNREGISTER, key[0], key[1])  # fails when unmapped meanwhile: nothing left
    if not _faults.ranges:  # nothing watched: the fds go, until something is
        _faults.close()


def _ioctl(request: int, start: int, end: int, *more: int) -> bool:
    """A userfaultfd ioctl on ``[start, end)``; whether it succeeded."""
    arg = bytearray(struct.pack(f"{2 + len(more)}Q", start, end - start, *more))
    try:
        fcntl.ioctl(_faults.uffd, request, arg)  # type: ignore[arg-type]
    except OSError:
        return False
    return True


# -- a worker's private mappings of shipments ---------------------------------------------------

#: The private mappings of shipments' buffers in this worker: start -> end.
_private: Dict[int, int] = {}
_PRESENT, _SWAPPED, _FILE = 1 << 63, 1 << 62, 1 << 61


def register_private(mapping: Any) -> None:
    """Records a private mapping of a memfd (a shipment's buffers: an ``mmap``, or a ctypes
    array over the mapping) while it lives."""
    view = (ctypes.c_char * len(mapping)).from_buffer(mapping)
    start = ctypes.addressof(view)
    del view
    _private[start] = start + len(mapping)
    weakref.finalize(mapping, _private.pop, start, None)


def private_unwritten(start: int, end: int) -> Optional[bool]:
    """For ``[start, end)`` inside a registered private mapping: whether every page of it
    is still the memfd's (None when the range lies in none)."""
    if not any(lo <= start and end <= hi for lo, hi in _private.items()):
        return None
    first, last = start // PAGE * PAGE, -(-end // PAGE) * PAGE
    scanned = _scan_own_pages(first, last)
    if scanned is not None:
        return scanned
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as f:
            data = os.pread(f.fileno(), (last - first) // PAGE * 8, first // PAGE * 8)
    except OSError:
        return False
    entries = struct.unpack(f"{len(data) // 8}Q", data)
    return not any(e & _SWAPPED or (e & _PRESENT and not e & _FILE) for e in entries)


def _scan_own_pages(start: int, end: int) -> Optional[bool]:
    """``private_unwritten`` by ``PAGEMAP_SCAN`` (no page present but not the file's, none
    swapped out), or None where the kernel lacks it."""
    pagemap = _own_pagemap()
    if pagemap is None:
        return None
    region = (ctypes.c_uint64 * 3)()
    vec = ctypes.addressof(region)
    for inverted, mask in ((_IS_FILE, _IS_PRESENT | _IS_FILE), (0, _IS_SWAPPED)):
        arg = bytearray(
            struct.pack("12Q", 96, 0, start, end, 0, vec, 1, 1, inverted, mask, 0, mask)
        )
        try:
            found = fcntl.ioctl(pagemap, _PAGEMAP_SCAN, arg)
        except OSError:
            return None
        if found:
            return False
    return True


_IS_FILE, _IS_PRESENT, _IS_SWAPPED = 1 << 2, 1 << 3, 1 << 4


def bounds(array: Any) -> Tuple[int, int]:
    """The bytes ``[low, high)`` a numpy array's elements span."""
    low = high = array.__array_interface__["data"][0]
    for size, stride in zip(array.shape, array.strides):
        if size == 0:
            return low, low
        reach = (size - 1) * stride
        if reach < 0:
            low += reach
        else:
            high += reach
    return low, high + array.itemsize
