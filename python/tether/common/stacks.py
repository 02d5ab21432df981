"""Stacks on demand from Python: what ``ProcessContext.stacks``, ``Pool.stacks`` and a
timed-out spawn ask of tether-core (``_native.stacks``), where py-spy is found for the
native frames, and ``Stacks``, the ranks' stacks with the summary that names the rank not
where the others wait (written by tether-core, as for ``tether run``)."""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any, Dict, List, Optional, Sequence

from tether import _native
from tether.spawn import process

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
    seconds = process.positive_seconds(timeout, "timeout")
    return _native.stacks(list(targets), seconds, py_spy() if native else None, dump_after)


class Stacks(Dict[int, str]):
    """Where every rank is: ``{rank: text}``, the text of each rank's stack (or why it has
    none), and ``summary``: one sentence that groups the ranks by where their main thread
    waits (the innermost frame of the user's code, and the call it waits in) and names
    those not where most others are, e.g. "ranks 0-1 wait in all_reduce called from
    train.py:57; rank 2 is elsewhere: data.py:31 in __getitem__". ``pids`` maps each rank
    to its pid. ``str()`` gives the whole block: each rank's stack, then the summary."""

    def __init__(self, texts: Dict[int, str], pids: Dict[int, int], summary: str) -> None:
        super().__init__(texts)
        self.pids = pids
        self.summary = summary

    def __str__(self) -> str:
        shown = "".join(
            f"-- rank {rank} (pid {self.pids.get(rank, '?')}):\n{text}\n\n"
            for rank, text in self.items()
        )
        return f"{shown}summary: {self.summary}"

    def __reduce__(self) -> Any:
        return type(self), (dict(self), self.pids, self.summary)


def of_ranks(ranks: Sequence[int], answers: List[_native.StackAnswer]) -> Stacks:
    """The answers of ``ranks`` (in order) as ``Stacks``, with their summary."""
    return Stacks(
        {rank: answer.text for rank, answer in zip(ranks, answers)},
        {rank: answer.pid for rank, answer in zip(ranks, answers)},
        _native.stacks_summary(list(ranks), answers),
    )
