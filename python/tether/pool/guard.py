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

The parent does not wait for a worker to get there when it can tell at once: a pool whose
workers import the main script (not ``"fork"``), started by a script run from its file
(``python script.py``, IPython's ``%run``) while the script's top-level statement under way is
one no condition guards (no ``if``, loop or ``match`` around it, nor a ``try``'s handlers or
``else``), raises the same error in the parent before any worker starts
(``unguarded_start``): every worker would run that statement too, and its import of the
script would take as long as the script took to get there (seconds, for a script that
imports torch first). A statement under any condition is left to the workers' check, which
knows whether the condition holds there.

A process that is not importing a main script (the parent; a worker running a task; a
``__main__`` without a file: the REPL, ``python -c``, a notebook) is never stopped here."""

from __future__ import annotations

import ast
import linecache
import multiprocessing.process
import os
import sys
from types import FrameType
from typing import Any, List, Optional, Tuple, cast

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


def check_start(owner: str, start_method: str) -> None:
    """Before a pool ``owner`` starts workers: ``check``, and in the process that starts it,
    ``BrokenPool`` when its workers would start it again (``unguarded_start``)."""
    check(owner)
    said = unguarded_start(owner, start_method)
    if said is not None:
        from tether.common import words

        from .errors import BrokenPool

        raise BrokenPool(words.main_not_guarded_here(said))


def _since(name: str) -> Tuple[type, ...]:
    """The statement class ``ast.NAME`` where this Python has it."""
    kind = getattr(ast, name, None)
    return () if kind is None else (kind,)


#: Statements that may skip what they hold (``match`` from Python 3.10).
_CONDITIONS = (ast.If, ast.For, ast.AsyncFor, ast.While, *_since("Match"))
#: Statements whose body runs (``try*`` from Python 3.11).
_TRIES = (ast.Try, *_since("TryStar"))


def unguarded_start(owner: str, start_method: str) -> Optional[str]:
    """In the process that starts a pool: what ``MainNotGuardedError`` would say when its
    workers would run the statement under way again (see the module's documentation), or
    None."""
    if start_method == "fork" or importing_main():
        return None
    main = sys.modules.get("__main__")
    if main is None or getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return None  # run with -m: left to the workers' check
    path = getattr(main, "__file__", None)
    if not isinstance(path, str) or path.startswith("<"):
        return None
    frame: Optional[FrameType] = sys._getframe(1)
    top: Optional[FrameType] = None
    while frame is not None:
        if frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>":
            top = frame
        frame = frame.f_back
    if top is None or not _unguarded(top.f_code.co_filename, top.f_lineno):
        return None
    from tether.common import words

    where, line = _user_line(top)
    return words.main_not_guarded(owner, where, line)


def _unguarded(filename: str, lineno: int) -> bool:
    """Whether the top-level statement of ``filename`` that holds line ``lineno`` runs
    whenever the file runs: inside no ``if``, loop or ``match``, nor a ``try``'s handlers
    or ``else`` (the body of a ``with`` or a ``try`` counts)."""
    try:
        body: List[ast.stmt] = ast.parse("".join(linecache.getlines(filename))).body
    except (SyntaxError, ValueError):
        return False
    while True:
        holding = [s for s in body if s.lineno <= lineno <= (s.end_lineno or s.lineno)]
        if len(holding) != 1 or isinstance(holding[0], _CONDITIONS):
            return False
        statement = holding[0]
        if isinstance(statement, (ast.With, ast.AsyncWith)):
            inner = statement.body
        elif isinstance(statement, _TRIES):
            tried = cast(ast.Try, statement)  # or an ast.TryStar, which has its fields
            inner = tried.body + tried.finalbody
        else:
            return True
        if not any(s.lineno <= lineno <= (s.end_lineno or s.lineno) for s in inner):
            # A with statement's own line runs; a try's handlers and else may not.
            return isinstance(statement, (ast.With, ast.AsyncWith))
        body = inner


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
