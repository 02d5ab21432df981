"""The missing main guard, named at once.

A ``"forkserver"`` or ``"spawn"`` worker imports the parent's main script (as
``__mp_main__``) to find the functions it is sent, as multiprocessing's spawn children do.
A script that starts a pool outside ``if __name__ == "__main__":`` would start one again in
every worker, each worker's pool would start workers of its own, and the parent would wait
for workers that never become ready. Instead, a worker whose import of the main script
reaches the start of a pool (``tether.Pool(...)``, or the first ``submit`` or ``map`` that
starts a ``tether.ProcessPoolExecutor``'s workers) raises ``MainNotGuardedError`` there,
naming the line of the script that did it; the worker's report carries it to the parent,
which raises ``BrokenPool`` with the same words (see ``words.main_not_guarded``) as soon as
the worker has exited.

A process that is not importing a main script (the parent; a worker running a task; a
``__main__`` without a file: the REPL, ``python -c``, a notebook) is never stopped here."""

from __future__ import annotations

import linecache
import multiprocessing.process
import os
import sys
from types import FrameType
from typing import Any, Optional, Tuple

#: The package whose frames are never the user's line.
_TETHER = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: The name a worker runs the parent's main script under.
_MP_MAIN = "__mp_main__"


class MainNotGuardedError(RuntimeError):
    """A worker, importing the parent's main script, reached the start of a pool: the script
    starts it outside ``if __name__ == "__main__":``. ``owner`` names the pool
    (``tether.Pool``), ``where`` is ``file:line`` and ``line`` that line's text."""

    def __init__(self, message: str, owner: str, where: str, line: str) -> None:
        super().__init__(message)
        self.owner = owner
        self.where = where
        self.line = line

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        return type(self), (self.args[0], self.owner, self.where, self.line)


def importing_main() -> bool:
    """Whether this process is a child still importing its parent's main module
    (multiprocessing's own "bootstrapping" flag, which tether's children set alike)."""
    return bool(getattr(multiprocessing.process.current_process(), "_inheriting", False))


def check(owner: str) -> None:
    """Raises ``MainNotGuardedError`` when this process is importing its parent's main
    script (see the module's documentation); ``owner`` names the pool being started."""
    if not importing_main():
        return
    from tether.common import words

    where, line = _user_line(sys._getframe(1))
    raise MainNotGuardedError(words.main_not_guarded(owner, where, line), owner, where, line)


def _user_line(frame: Optional[FrameType]) -> Tuple[str, str]:
    """``(file:line, text)`` of the script's top-level line that led here: the outermost
    frame of the main script being imported, or else the innermost frame outside tether."""
    outermost_main: Optional[FrameType] = None
    first_outside: Optional[FrameType] = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if first_outside is None and not filename.startswith(_TETHER):
            first_outside = frame
        if frame.f_globals.get("__name__") == _MP_MAIN:
            outermost_main = frame
        frame = frame.f_back
    chosen = outermost_main or first_outside
    if chosen is None:
        return "<unknown>", ""
    filename, lineno = chosen.f_code.co_filename, chosen.f_lineno
    return f"{filename}:{lineno}", linecache.getline(filename, lineno).strip()
