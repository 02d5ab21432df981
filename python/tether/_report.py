"""The failure report a child writes to its report pipe, and its reading in the parent.

One frame: an 8-byte little-endian length, then a pickled ``(traceback_text, exception)``
where ``exception`` is the pickled exception, or None when it does not pickle. The parent
always gets the traceback text; it gets the exception object when it also unpickles."""

from __future__ import annotations

import os
import pickle
import struct
import traceback
from types import TracebackType
from typing import Optional, Tuple

_HEADER = struct.Struct("<Q")


def _user_frames(tb: Optional[TracebackType]) -> Optional[TracebackType]:
    """The traceback without tether's own bootstrap frames on top."""
    while tb is not None and tb.tb_frame.f_globals.get("__name__") == "tether._child":
        tb = tb.tb_next
    return tb


def encode(exc: BaseException) -> bytes:
    tb = _user_frames(exc.__traceback__)
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        pickled: Optional[bytes] = pickle.dumps(exc)
    except Exception:
        pickled = None
    body = pickle.dumps((text, pickled))
    return _HEADER.pack(len(body)) + body


def write(fd: int, exc: BaseException) -> None:
    """Writes the report of ``exc`` whole (blocking; the supervisor drains it meanwhile)."""
    view = memoryview(encode(exc))
    while view:
        view = view[os.write(fd, view) :]


def decode(data: bytes) -> Optional[Tuple[str, Optional[BaseException]]]:
    """The traceback text and the rebuilt exception (None when it cannot be rebuilt), or
    None when no complete report arrived."""
    if len(data) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack_from(data)
    body = data[_HEADER.size : _HEADER.size + size]
    if len(body) < size:
        return None
    text, pickled = pickle.loads(body)
    exc: Optional[BaseException] = None
    if pickled is not None:
        try:
            loaded = pickle.loads(pickled)
        except Exception:
            loaded = None
        if isinstance(loaded, BaseException):
            exc = loaded
    return text, exc
