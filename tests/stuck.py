"""Code that gets stuck in known places, for the stacks tests: ``stuck_here(kind)`` blocks in
``time.sleep``, in a ``Queue.get``, on a ``threading.Lock`` held by another thread, or spins
in C with the GIL held (a regular expression in catastrophic backtracking), each on a line
marked ``# stuck: KIND`` (``line_of`` finds it). Nothing here blocks for ever: ``limit``
bounds the waits (the regular expression is stopped by killing its process)."""

from __future__ import annotations

import queue
import re
import threading
import time

KINDS = ("sleep", "queue", "lock", "regex")
FILE = __file__


def stuck_here(kind: str, limit: float = 60.0) -> None:
    if kind == "sleep":
        time.sleep(limit)  # stuck: sleep
    elif kind == "queue":
        queue.Queue().get(timeout=limit)  # stuck: queue
    elif kind == "lock":
        lock = threading.Lock()
        held = threading.Event()
        threading.Thread(target=hold, args=(lock, held, limit), daemon=True).start()
        held.wait(limit)
        lock.acquire(timeout=limit)  # stuck: lock
    elif kind == "regex":
        re.match(r"(a+)+$", "a" * 64 + "b")  # stuck: regex
    else:
        raise ValueError(kind)


def hold(lock: threading.Lock, held: threading.Event, limit: float) -> None:
    with lock:
        held.set()
        time.sleep(limit)


def rank(i: int) -> None:
    """A rank stuck in the kind its number picks."""
    stuck_here(KINDS[i % len(KINDS)])


def line_of(kind: str) -> int:
    """The line of ``stuck_here`` that a rank of ``kind`` is stuck on."""
    with open(FILE) as f:
        for number, line in enumerate(f, start=1):
            if line.rstrip().endswith(f"# stuck: {kind}"):
                return number
    raise ValueError(kind)
