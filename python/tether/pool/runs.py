"""The DataLoader iterators a pool serves, each as a *run*: the leases of its workers, the
queues and event it shares with them, and whether the pool took its workers back.

A pool is shared, so an iterator must not hold workers it will not use. An iterator whose
last ``next()`` raised (a worker's exception re-raised, a worker that died, a
KeyboardInterrupt) is *failed*: its exception may be kept for ever (IPython's
``sys.last_value``, a list of errors), and the exception keeps the iterator, and the
iterator its workers. When a task or another loader waits for a worker, the pool takes a
failed run's workers back, and shutting the pool down takes every run's back. Taking back
is torch's own way to end a worker loop: the iterator's done event is set and each worker
reads ``None`` from its index queue, so that the loop returns and the worker serves
someone else; a worker that has not returned after ``GRACE`` seconds is killed (the pool
starts another). The iterator's next ``next()`` raises an error that says its workers were
taken back and why.

torch's DataLoader watches its workers by pid (``_set_worker_pids`` when an iterator starts,
``_remove_worker_pids`` when it shuts down): its SIGCHLD handler raises "DataLoader worker
(pid N) is killed by signal" in the main thread for a watched pid that dies by a signal. So
``untrack`` makes torch stop watching a worker before the pool kills it or lends it to
someone else; this module learns which iterator watches which pid by wrapping torch's two
functions (they behave as before)."""

from __future__ import annotations

import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from tether import _native

__all__ = ["GRACE", "Run", "install_pid_tracking", "untrack"]

#: How long a worker loop taken back may take to return before its worker is killed.
GRACE = 2.0


class Run:
    """One DataLoader iterator's leases, as the pool sees them (see the module)."""

    def __init__(self, description: str, done_event: Any) -> None:
        self.description = description
        self.leases: List[_native.Lease] = []
        self._index_queues: List["weakref.ReferenceType[Any]"] = []
        self._done_event = _weak(done_event)
        #: Why its last next() raised, while that is the last thing it did.
        self.failure: Optional[str] = None
        #: Why the pool took its workers back, once it did.
        self.taken_back: Optional[str] = None
        #: Told when the run fails (the pool may take its workers back).
        self.on_failure: Optional[Callable[["Run"], None]] = None

    def add(self, lease: _native.Lease, index_queue: Any) -> None:
        self.leases.append(lease)
        ref = _weak(index_queue)
        if ref is not None:
            self._index_queues.append(ref)

    @property
    def pids(self) -> List[int]:
        return [lease.pid for lease in self.leases]

    def live(self) -> bool:
        """Whether one of its leases still runs."""
        return any(lease.end() is None for lease in self.leases)

    # -- what its queue tells (see ``loader._LoaderQueue``) -------------------------------------

    def using(self) -> None:
        """Its iterator waits for data: its last next() is under way."""
        self.failure = None

    def failed(self, what: str) -> None:
        """Its iterator's next() raised ``what``."""
        if self.taken_back is not None:
            return
        self.failure = what
        notify = self.on_failure
        if notify is not None:
            notify(self)

    def check(self) -> None:
        """Raises the error of a run taken back."""
        if self.taken_back is not None:
            raise self.error()

    def error(self) -> RuntimeError:
        pids = ", ".join(map(str, self.pids))
        return RuntimeError(
            f"the workers of this {self.description} (pid {pids}) were taken back by the "
            f"tether.Pool: {self.taken_back}. Make a new iterator to go on (with "
            "persistent_workers=True, a new DataLoader)."
        )

    # -- taking back -----------------------------------------------------------------------

    def take_back(self, why: str) -> List[_native.Lease]:
        """Ends the run's worker loops as torch does (see the module); returns the leases
        that still run (the caller kills those that outlive ``GRACE``)."""
        if self.taken_back is not None:
            return []
        self.taken_back = why
        untrack(self.pids)
        event = _deref(self._done_event)
        if event is not None:
            event.set()
        for ref in self._index_queues:
            queue = ref()
            if queue is not None:
                try:
                    queue.put(None, block=False)
                except Exception:  # noqa: BLE001 - closed, or full: the grace ends it
                    pass
        return [lease for lease in self.leases if lease.end() is None]


def kill_after(
    leases: List[_native.Lease], kill: Callable[[_native.Lease], None], grace: float = GRACE
) -> None:
    """Waits up to ``grace`` seconds for ``leases`` to end, then kills the workers of those
    that still run."""
    deadline = time.monotonic() + grace
    for lease in leases:
        lease.wait(max(0.0, deadline - time.monotonic()))
    for lease in leases:
        if lease.end() is None:
            kill(lease)


def kill_later(leases: List[_native.Lease], kill: Callable[[_native.Lease], None]) -> None:
    """``kill_after`` on a thread of its own (nobody waits for it); here when no thread can
    start (the interpreter is exiting)."""
    if not leases:
        return
    thread = threading.Thread(
        target=kill_after, args=(leases, kill), name="tether-pool-take-back", daemon=True
    )
    try:
        thread.start()
    except RuntimeError:
        kill_after(leases, kill)


def _weak(obj: Any) -> Optional["weakref.ReferenceType[Any]"]:
    try:
        return None if obj is None else weakref.ref(obj)
    except TypeError:
        return None


def _deref(ref: Optional["weakref.ReferenceType[Any]"]) -> Any:
    return None if ref is None else ref()


# -- torch's watch of its workers' pids --------------------------------------------------------

_lock = threading.Lock()
#: torch's key (the id of an iterator) -> the pids it watches.
_tracked: Dict[int, Tuple[int, ...]] = {}
_functions: Optional[Tuple[Callable[..., Any], Callable[..., Any]]] = None


def install_pid_tracking() -> None:
    """Wraps torch's ``_set_worker_pids`` and ``_remove_worker_pids`` (once), so that
    ``untrack`` knows which iterator watches which pid."""
    global _functions
    module = sys.modules.get("torch.utils.data._utils.signal_handling")
    if module is None or _functions is not None:
        return
    set_pids, remove_pids = module._set_worker_pids, module._remove_worker_pids

    def _set_worker_pids(key: int, pids: Iterable[int]) -> None:
        pids = tuple(pids)
        set_pids(key, pids)
        with _lock:
            _tracked[key] = pids

    def _remove_worker_pids(key: int) -> None:
        with _lock:
            _tracked.pop(key, None)
        remove_pids(key)

    _functions = (set_pids, remove_pids)
    # torch's DataLoader calls both through the module at every iterator (torch's private
    # names, not in its type stubs).
    setattr(module, "_set_worker_pids", _set_worker_pids)  # noqa: B010
    setattr(module, "_remove_worker_pids", _remove_worker_pids)  # noqa: B010


def untrack(pids: Iterable[int]) -> None:
    """Makes torch stop watching ``pids`` (its iterators keep watching their other pids)."""
    gone = set(pids)
    if _functions is None or not gone:
        return
    set_pids, remove_pids = _functions
    with _lock:
        for key, tracked in list(_tracked.items()):
            if gone.intersection(tracked):
                left = tuple(pid for pid in tracked if pid not in gone)
                remove_pids(key)
                set_pids(key, left)
                _tracked[key] = left
