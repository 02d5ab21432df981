"""Stacks on demand from Python: what ``ProcessContext.stacks``, ``Pool.stacks`` and a
timed-out spawn ask of tether-core (``_native.stacks``), and where py-spy is found for the
native frames."""

from __future__ import annotations

import math
import numbers
import os
import shutil
import sys
from typing import Any, List, Optional, Sequence, Tuple

from . import _native

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


def check_timeout(value: Any, name: str = "timeout") -> float:
    """A positive number of seconds (``inf`` allowed); anything else is an error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    seconds = float(value)
    if math.isnan(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
    return seconds


def ask(
    targets: Sequence[Tuple[_native.Group, int]],
    timeout: Any,
    native: bool,
    dump_after: Optional[float] = None,
) -> List[_native.StackAnswer]:
    """Asks every ``(group, index)`` at once; the answer of each, in order.
    With ``native``, py-spy's view is added when py-spy is installed (and silently left
    out when it is not). ``dump_after`` (seconds) is how long a process may take to begin
    answering from its interpreter before its main thread is dumped from a signal handler
    (0.1 s by default)."""
    seconds = check_timeout(timeout)
    return _native.stacks(list(targets), seconds, py_spy() if native else None, dump_after)


def _mask(pid: int, field: str) -> int:
    """A signal mask of /proc/PID/status (``SigBlk``, ``SigCgt``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1], 16)
    return 0


def _is_launcher(pid: int) -> bool:
    """Whether ``pid`` is a running ``tether run`` (its keeper or its supervisor): such a
    process reads the stack signal from a signalfd, so it keeps it blocked."""
    try:
        blocked = _mask(pid, "SigBlk")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    named = any(os.path.basename(a).startswith(b"tether") for a in argv) and b"run" in argv
    return named and bool(blocked & (1 << (_native.STACKS_SIGNAL - 1)))


def stacks_main(argv: List[str]) -> int:
    """``tether stacks PID``: asks the ``tether run`` whose pid is PID to print every rank's
    stack on its stderr (as ``kill -USR1 PID`` does); the run goes on."""
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: tether stacks PID  (PID: the pid of a running `tether run`)", flush=True)
        return 0 if argv in (["-h"], ["--help"]) else 2
    pid = int(argv[0])
    if not _is_launcher(pid):
        print(f"tether stacks: pid {pid} is not a running `tether run`", file=sys.stderr)
        return 1
    try:
        os.kill(pid, _native.STACKS_SIGNAL)
    except PermissionError:
        print(
            f"tether stacks: pid {pid} belongs to another user: ask as that user (or as root)",
            file=sys.stderr,
        )
        return 1
    except ProcessLookupError:
        print(f"tether stacks: pid {pid} is not a running `tether run`", file=sys.stderr)
        return 1
    print(f"tether stacks: asked `tether run` (pid {pid}); the stacks appear on its stderr")
    return 0
