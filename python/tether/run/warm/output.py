"""What a warm zygote's preload writes on stdout and stderr: kept in memory files instead
of reaching the user's streams, and cut into the nodes being imported (``Output.cut``), so
that each rank writes it when its own import comes (``run.warm.serve``)."""

from __future__ import annotations

import ctypes
import fcntl
import os
import sys
from typing import Any, Dict, Optional, Set

from .nodes import Write

_libc = ctypes.CDLL(None)


class Output:
    """Keeps what is written on fds 1 and 2 (in memory files) instead of letting it reach
    the user's streams; ``cut`` gives a node what was written since the last cut."""

    def __init__(self) -> None:
        self.files: Dict[int, int] = {}
        self.saved: Dict[int, Optional[int]] = {}
        self.offsets: Dict[int, int] = {1: 0, 2: 0}

    def __enter__(self) -> "Output":
        _flush()
        for fd in (1, 2):
            self.files[fd] = _high(os.memfd_create(f"tether-preload-{fd}"))
            try:
                self.saved[fd] = _high(os.dup(fd))
            except OSError:
                self.saved[fd] = None  # closed: it stays closed afterwards
            os.dup2(self.files[fd], fd)
        return self

    def fds(self) -> Set[int]:
        saved = {fd for fd in self.saved.values() if fd is not None}
        return set(self.files.values()) | saved

    def cut(self, node: Any) -> None:
        _flush()
        for fd, file in self.files.items():
            size = os.fstat(file).st_size
            if size > self.offsets[fd]:
                data = os.pread(file, size - self.offsets[fd], self.offsets[fd])
                self.offsets[fd] = size
                if node is not None:
                    node.ops.append(Write(fd, data))

    def __exit__(self, *exc: object) -> None:
        _flush()
        for fd, file in self.files.items():
            copy = self.saved[fd]
            if copy is None:
                os.close(fd)
            else:
                os.dup2(copy, fd)
                os.close(copy)
            os.close(file)
        self.files.clear()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001 - a stream the import replaced, or closed
            pass
    _libc.fflush(None)  # what C code buffered in stdio


def _high(fd: int) -> int:
    """``fd`` moved to a number above the standard streams' (close-on-exec)."""
    if fd > 2:
        return fd
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(fd)
    return high
