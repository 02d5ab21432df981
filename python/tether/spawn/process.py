"""One child of a ``ProcessContext`` as ``multiprocessing.Process`` shows it (what torch's
users rely on), and the timeouts ``join`` takes, read as torch reads them."""

from __future__ import annotations

import math
import numbers
import signal
from typing import Any, Optional

from tether import _native


class Process:
    """One child of a ``ProcessContext``, with the attributes of ``multiprocessing.Process``
    that torch's users rely on."""

    def __init__(self, group: _native.Group, index: int, daemon: bool) -> None:
        self._group = group
        self._index = index
        self.daemon = daemon
        self.pid: int = group.pid(index)
        self.name = f"TetherProcess-{index}"

    @property
    def status(self) -> Optional[_native.ExitStatus]:
        """None while running; then how the process ended."""
        return self._group.exit(self._index)

    @property
    def exitcode(self) -> Optional[int]:
        """None while running; the exit code, or minus the signal number. Also None once
        exited when the status is unavailable (something else reaped the process)."""
        status = self.status
        return None if status is None else status.exitcode

    @property
    def sentinel(self) -> int:
        """An fd that becomes readable when the process ends (its pidfd)."""
        return self._group.sentinel(self._index)

    @property
    def ident(self) -> int:
        return self.pid

    def is_alive(self) -> bool:
        return self.status is None

    def join(self, timeout: Optional[float] = None) -> None:
        self._group.wait([self._index], _native.WaitFor.ALL, seconds(timeout, "timeout"))

    def close(self) -> None:
        """As ``multiprocessing.Process.close``: an error while the process runs (its pidfd
        and report are released with its context)."""
        if self.is_alive():
            raise ValueError("Cannot close a process while it is still running.")

    def terminate(self) -> None:
        """SIGTERM to the process and its process group."""
        self._group.signal(self._index, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the process and its process group."""
        self._group.signal(self._index, signal.SIGKILL)

    def __repr__(self) -> str:
        status = self.status
        state = "alive" if status is None else str(status)
        return f"<{type(self).__name__} {self.name} pid={self.pid} {state}>"


def seconds(value: Any, name: str) -> Optional[float]:
    """A timeout or grace period as ``join`` takes it: None, or a number of seconds (NaN and
    non-numbers are errors; a negative one means "do not wait", a huge one "for ever")."""
    if value is None:
        return None
    if not isinstance(value, numbers.Real):  # a bool is 0 or 1 second, as for torch
        raise TypeError(f"{name} must be a number of seconds or None, not {type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:
        return math.inf
    if math.isnan(seconds):
        raise ValueError(f"{name} must be a number of seconds or None, not NaN")
    return seconds


def positive_seconds(value: Any, name: str) -> float:
    """A number of seconds above 0 (``inf`` allowed), as a stacks request's timeout: None, a
    bool, NaN and other values are errors."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    number = float(value)
    if math.isnan(number) or number <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
    return number
