"""Stacks on demand from Python: what ``ProcessContext.stacks``, ``Pool.stacks`` and a
timed-out spawn ask of tether-core (``_native.stacks``), and where py-spy is found for the
native frames."""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any, List, Optional, Sequence

from . import _native, _process

#: How long a request waits for the stacks by default.
DEFAULT_TIMEOUT = 5.0


def py_spy() -> Optional[str]:
    """The py-spy program: the one ``TETHER_PY_SPY`` names (none when it is empty), else
    the one on ``PATH`` or beside this interpreter (a virtual environment that is not
    activated); None when it is not installed."""
    chosen = os.environ.get(_native.PY_SPY_ENV)
    if chosen is not None:
        return chosen or None
    return shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))


def ask(
    targets: Sequence[_native.Member],
    timeout: Any,
    native: bool,
    dump_after: Optional[float] = None,
) -> List[_native.StackAnswer]:
    """Asks every member at once; the answer of each, in order.
    With ``native``, py-spy's view is added when py-spy is installed (and silently left
    out when it is not). ``dump_after`` (seconds) is how long a process may take to begin
    answering from its interpreter before its main thread is dumped from a signal handler
    (0.1 s by default)."""
    seconds = _process.positive_seconds(timeout, "timeout")
    return _native.stacks(list(targets), seconds, py_spy() if native else None, dump_after)
