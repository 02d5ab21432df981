"""When a pool worker may trust, at the start of a lease, the proof that its copy of a
loader's objects is as the parent sent it (``shipment._Copy``), without walking the copy
again.

A copy is proven (its snapshot walked, or the copy made again) after each lease that used
it, once the garbage the lease left in the young generations is freed (see
``worker._collect_young_garbage``), and once the worker is idle, after its garbage
collection. The proof holds for as long as nothing but the worker's own loop can have run:
each thing that may run other code starts a new *epoch* (``touched``): a lease, an executor
task, a garbage collection (finalizers, weak reference callbacks), a copy dropped or made
again (its objects' own code). What could run without the worker's loop knowing it (another
thread, a trace or profile function or monitoring tool, a signal handler of Python code) is
looked for after each proof (``decide``): when any is there, every lease proves its copies
again."""

from __future__ import annotations

import gc
import signal
import sys
import threading
import types
from typing import Any, Dict

__all__ = ["decide", "epoch", "holds", "touched", "watch_collections"]

#: The current epoch (see the module's documentation).
epoch = 0
#: Whether nothing can run between the worker's messages but its own loop (``decide``).
_quiet = False


def touched() -> None:
    """Code other than the worker's own loop may have run: every copy is proven again at
    its next use."""
    global epoch
    epoch += 1


def holds(proven: int) -> bool:
    """Whether a copy proven in epoch ``proven`` is still as proven."""
    return proven == epoch and _quiet


def decide() -> None:
    """After the copies were proven: whether the next lease may trust those proofs."""
    global _quiet
    _quiet = _nothing_else_runs()


def _on_collection(phase: str, info: Dict[str, Any]) -> None:
    # Finalizers and weak reference callbacks may have run, even when the collection freed
    # nothing (a finalizer that resurrects its object counts as nothing collected).
    if phase == "stop":
        touched()


def watch_collections() -> None:
    """Called once in a worker: every garbage collection ends the epoch."""
    if _on_collection not in gc.callbacks:
        gc.callbacks.append(_on_collection)


def _nothing_else_runs() -> bool:
    """Whether only the worker's own loop can run while it waits for a message: a single
    thread, no trace or profile function or monitoring tool, no signal handler but built-in
    functions of modules (``KeyboardInterrupt``'s, tether's own stack reporter)."""
    if threading.active_count() != 1 or sys.gettrace() is not None or sys.getprofile() is not None:
        return False
    monitoring = getattr(sys, "monitoring", None)  # Python 3.12's tools: callbacks on any code
    if monitoring is not None and any(monitoring.get_tool(tool) for tool in range(6)):
        return False
    for signum in signal.valid_signals():
        handler = signal.getsignal(signum)
        if callable(handler) and not (
            isinstance(handler, types.BuiltinFunctionType)
            and (handler.__self__ is None or isinstance(handler.__self__, types.ModuleType))
        ):
            return False
    return True
