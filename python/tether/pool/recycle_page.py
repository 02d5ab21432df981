"""The release page of batch recycling (``recycle``): a memfd page of 64-bit words, one per
slot, that a worker makes and maps, and that each process receiving its storages maps too, to
write in a slot that the storage sent with it is gone."""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any, Optional, Tuple

#: How many storages a worker keeps at most (one word of its page each).
SLOTS = 16
PAGE = 4096


class Libc:
    """``mmap`` and ``munmap`` without an fd kept open (``mmap.mmap`` keeps a duplicate)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(None, use_errno=True)
        self.mmap = lib.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        self.munmap = lib.munmap
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

    def map_page(self, fd: int) -> int:
        address = self.mmap(None, PAGE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if address is None or address == ctypes.c_void_p(-1).value:
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error))
        return int(address)


_libc_instance: Optional[Libc] = None


def libc() -> Libc:
    global _libc_instance
    if _libc_instance is None:
        _libc_instance = Libc()
    return _libc_instance


def words(address: int) -> Any:
    return (ctypes.c_uint64 * SLOTS).from_address(address)


class Page:
    """This worker's release page."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("tether release page", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, PAGE)
            self.address = libc().map_page(self.fd)
        except BaseException:
            os.close(self.fd)
            raise
        self.words = words(self.address)
        #: The next generation: unique to this page (it starts anywhere in 2**62).
        self.generation = int.from_bytes(os.urandom(8), "little") >> 2 | 1

    def close(self) -> None:
        libc().munmap(self.address, PAGE)
        os.close(self.fd)


class Mapped:
    """A worker's release page, as a receiving process maps it while it watches storages of
    that worker."""

    __slots__ = ("key", "address", "words", "users")

    def __init__(self, key: Tuple[int, int], fd: int) -> None:
        self.key = key
        self.address = libc().map_page(fd)
        self.words = words(self.address)
        self.users = 0
