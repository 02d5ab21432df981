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
from typing import Callable, NamedTuple, Optional, Tuple

from tether import _native

from . import pickling


class Described(NamedTuple):
    """An exception as it crosses to another process (a spawn child's report, a pool task's
    error, a failed ``tether.share`` build): its type's name, its message, its traceback's
    text, and the exception pickled (None when it does not pickle). ``describe`` makes it,
    ``rebuild`` turns it back into an exception on the other side."""

    type_name: str
    message: str
    text: str
    pickled: Optional[bytes]


def describe(
    exc: BaseException, dumps: Optional[Callable[[BaseException], bytes]] = None
) -> Described:
    """``exc`` described to cross to another process, its traceback from the first frame
    that is not tether's own (the bootstrap of a child, the loop of a worker, the call of a
    build; the whole traceback when every frame is tether's); ``dumps`` pickles it (by
    default: ``pickle``, then tether's own pickler for a ``__main__`` without a file). A
    broken ``__str__`` or ``__repr__`` loses nothing else."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith("tether."):
        tb = tb.tb_next
    if tb is None:  # raised in tether's own code: all of it is worth showing
        tb = exc.__traceback__
    try:
        text = "".join(traceback.format_exception(type(exc), exc, tb))
    except BaseException as error:  # noqa: BLE001 - a broken __str__ or __repr__
        text = f"{type(exc).__qualname__}: <cannot format the exception: {error!r}>\n"
    try:
        message = str(exc)
    except BaseException:  # noqa: BLE001 - the text must get through whatever happens here
        message = "<the exception's message cannot be shown>"
    try:
        pickled_exc: Optional[bytes] = (dumps or pickled)(exc) or None
    except BaseException:  # noqa: BLE001 - SystemExit in a __reduce__ included
        pickled_exc = None
    return Described(type(exc).__qualname__, message, text, pickled_exc)


def rebuild(described: Described, where: str = "") -> BaseException:
    """The exception ``described``, rebuilt here with the other side's traceback as its
    cause (as ``concurrent.futures`` gives a worker's; ``where`` opens it), or
    ``tether.RemoteError`` with its type's name, message and traceback when it cannot be
    rebuilt."""
    from concurrent.futures.process import _RemoteTraceback

    from tether.errors import RemoteError

    type_name, message, text, pickled_exc = described
    exc = unpickle_exception(pickled_exc) or RemoteError(type_name, message, text)
    # It takes the traceback's text (its type stubs say a traceback object).
    exc.__cause__ = _RemoteTraceback(f'\n"""\n{where}{text}"""')  # type: ignore[arg-type]
    return exc


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
    """The report frame of ``exc`` (see the module's docstring)."""
    described = describe(exc)
    text = described.text.encode(errors="replace")
    return bytes(_native.encode_report(described.type_name, text, described.pickled or b""))


def write(fd: int, exc: BaseException) -> None:
    """Writes the report of ``exc`` whole (blocking; the warden drains it meanwhile)."""
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
