"""One describer and one rebuilder of an exception that crosses a process
(``tether.common.reports``): a spawn child's report, a pool task's error and a failed
``tether.share`` build all use them, so each comes back as itself (or as
``tether.RemoteError`` when its class cannot cross) with the other side's traceback as its
``__cause__``, from the user's first frame."""

from __future__ import annotations

import pickle
import threading
from concurrent.futures.process import _RemoteTraceback

import tether
from tether.common import reports


class BrokenStrError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str")


class HoldsALockError(Exception):
    def __init__(self) -> None:
        super().__init__("locked")
        self.lock = threading.Lock()  # does not pickle


def raised(exc: BaseException) -> BaseException:
    try:
        raise exc  # the user's line
    except BaseException as caught:  # noqa: BLE001
        return caught


def test_an_exception_that_pickles_comes_back_as_itself_with_its_traceback_as_cause() -> None:
    described = reports.describe(raised(ValueError("bad value")))
    assert described.type_name == "ValueError" and described.message == "bad value"
    assert "raise exc  # the user's line" in described.text
    back = reports.rebuild(pickle.loads(pickle.dumps(described)), "over there:\n")
    assert type(back) is ValueError and back.args == ("bad value",)
    assert type(back.__cause__) is _RemoteTraceback
    assert back.__cause__.tb.startswith('\n"""\nover there:\nTraceback')  # type: ignore[attr-defined]


def test_one_that_cannot_cross_is_a_remote_error_with_its_name_message_and_text() -> None:
    described = reports.describe(raised(HoldsALockError()))
    assert described.pickled is None
    back = reports.rebuild(described)
    assert isinstance(back, tether.RemoteError)
    assert (back.type_name, back.message) == ("HoldsALockError", "locked")
    assert "the user's line" in back.traceback


def test_a_broken_str_loses_nothing_else() -> None:
    described = reports.describe(raised(BrokenStrError()))
    assert described.type_name == "BrokenStrError"
    assert described.message == "<the exception's message cannot be shown>"
    assert "BrokenStrError" in described.text


def test_tethers_own_frames_on_top_are_left_out() -> None:
    def user() -> None:
        raise KeyError("k")

    # A frame of tether's (a child's bootstrap, a worker's loop) that calls the user's code.
    space = {"__name__": "tether.somewhere", "user": user}
    exec("def call():\n    user()\n", space)
    try:
        space["call"]()  # type: ignore[operator]
    except KeyError as exc:
        assert exc.__traceback__ is not None
        exc.__traceback__ = exc.__traceback__.tb_next  # from tether's frame on
        text = reports.describe(exc).text
    frames = [line for line in text.splitlines() if line.startswith("  File ")]
    assert len(frames) == 1 and "test_remote_errors.py" in frames[0] and "in user" in frames[0]


def test_an_exception_raised_in_tethers_own_code_keeps_its_whole_traceback() -> None:
    space: dict = {"__name__": "tether.somewhere"}
    exec("def inner():\n    raise OSError('no fd')\ndef outer():\n    inner()\n", space)
    try:
        space["outer"]()
    except OSError as exc:
        text = reports.describe(exc).text
    assert text.count('  File "<string>"') == 2 and "in inner" in text, text
