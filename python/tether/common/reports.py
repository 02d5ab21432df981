"""The failure report a child writes to its report pipe, and its reading in the parent.

The frame is tether-core's (``_native.encode_report``): the exception's type name, its
traceback text, then the pickled exception. Type and text come first, so that a report cut
at the size limit (``_native.REPORT_LIMIT``), or one whose writer died half-way, still says
what was raised and where. The parent gets the exception object too when it pickled in the
child and unpickles here."""

from __future__ import annotations

import os
import pickle
import traceback
from types import TracebackType
from typing import Optional, Tuple

from tether import _native

from . import pickling


def _user_frames(tb: Optional[TracebackType]) -> Optional[TracebackType]:
    """The traceback without tether's own bootstrap frames on top."""
    while tb is not None and tb.tb_frame.f_globals.get("__name__") == "tether.spawn.bootstrap":
        tb = tb.tb_next
    return tb


def pickled(exc: BaseException) -> bytes:
    """The pickled exception, or nothing when it does not pickle (whatever its ``__reduce__``
    raises: ``SystemExit`` and ``KeyboardInterrupt`` included). An exception class of a
    ``__main__`` without a file travels by value (no fd travels with a report: tether's
    pickler is asked only then)."""
    try:
        return pickle.dumps(exc)
    except BaseException:  # noqa: BLE001 - the text must get through whatever happens here
        pass
    if pickling.main_without_file():
        try:
            return pickling.dumps(exc, pickling.FdCollector())
        except BaseException:  # noqa: BLE001
            pass
    return b""


def encode(exc: BaseException) -> bytes:
    tb = _user_frames(exc.__traceback__)
    try:
        text = "".join(traceback.format_exception(type(exc), exc, tb))
    except BaseException as error:  # noqa: BLE001 - a broken __str__ or __repr__
        text = f"{type(exc).__qualname__}: <cannot format the exception: {error!r}>\n"
    type_name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    return bytes(_native.encode_report(type_name, text.encode(errors="replace"), pickled(exc)))


def write(fd: int, exc: BaseException) -> None:
    """Writes the report of ``exc`` whole (blocking; the supervisor drains it meanwhile)."""
    view = memoryview(encode(exc))
    while view:
        view = view[os.write(fd, view) :]


def decode(data: bytes) -> Optional[Tuple[str, Optional[BaseException]]]:
    """The traceback text and the rebuilt exception (None when it cannot be rebuilt), or
    None when not even the exception's type arrived. A report cut short says so in its
    text."""
    decoded = _native.decode_report(data)
    if decoded is None:
        return None
    text = decoded.text.decode(errors="replace")
    if decoded.missing:
        text += (
            f"\n[tether: this {decoded.type_name} report is incomplete: its last "
            f"{decoded.missing} bytes "
            f"were cut (reports are kept up to {_native.REPORT_LIMIT >> 20} MiB) or never "
            "written]\n"
        )
    return text, unpickle_exception(decoded.pickled)


def unpickle_exception(pickled: Optional[bytes]) -> Optional[BaseException]:
    """The exception pickled in another process, or None when there is none or it cannot
    be rebuilt here (its class is missing, or unpickling it raises anything)."""
    if pickled is None:
        return None
    try:
        loaded = pickle.loads(pickled)
    except BaseException:  # noqa: BLE001 - an exception that cannot be rebuilt here
        return None
    return loaded if isinstance(loaded, BaseException) else None
