"""The life of a pool (``tether.Pool``, ``tether.ProcessPoolExecutor``): its workers' start,
the hub thread that takes the worker set's events (results, ended leases, deaths) and hands
them on, the healing of a dead worker, and the states running -> shutdown -> closed.

Each worker is a direct child of this process, started by tether's launch layer (so it
leads its own process group and dies with this process). The worker set lives in Rust
(``_native.WorkerSet``): the table of workers, the tasks queued and in flight, which
worker runs which task, batch sizes, leases, and deaths seen on each worker's pidfd. A
worker that dies fails the task it was running (``WorkerCrashedError``, a
``BrokenProcessPool``); the tasks it never started run elsewhere, and a replacement starts
on a thread of its own, so the other workers' results keep flowing meanwhile. A pool starts
every worker at once and waits until they are ready, or (``start``) starts only some and
more when asked (``grow``), without waiting, as ``ProcessPoolExecutor`` does.

As ``concurrent.futures.ProcessPoolExecutor``: work submitted before shutdown finishes
before the interpreter exits (unless ``shutdown(cancel_futures=True)``), whether or not the
pool was shut down or garbage collected."""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
import time
import weakref
from typing import Any, Callable, List, Literal, Optional, Sequence

from tether import _native
from tether.common import reports, stacks, words
from tether.common.log import logger
from tether.spawn import census, launch

from . import guard, worker
from .errors import BrokenPool
from .leases import Leases, worker_state
from .tasks import Tasks, delivery

#: Messages of executor tasks in flight per worker (one running, one waiting in its socket).
WINDOW = 2
#: The most tasks one message carries.
MAX_BATCH = 256
#: The most a wait (the hub's, a waiting caller's, a worker's) polls before it sleeps: a
#: sleeping thread costs a wake-up when its message comes. Polling stops for a while when
#: it keeps finding nothing (a busy machine), where it would only take a core from the
#: process that answers.
SPIN = 0.0001
#: How long closing waits for workers to exit after closing their links, before SIGKILL.
EXIT_GRACE = 2.0

State = Literal["running", "shutdown", "closed"]


class Core:
    """The pool's state, shared by its faces (``facade.Pool``, ``executor.ProcessPoolExecutor``),
    the hub thread and the replacement threads (none of which keeps a face alive). Its tasks
    (``tasks.Tasks``) and its leases (``leases.Leases``, which a pool context asks for
    workers directly) know it through their protocols, ``TaskHost`` and ``LeaseHost``."""

    def __init__(
        self,
        processes: int,
        start_method: str,
        preload: Sequence[str],
        initializer: Optional[Callable[..., Any]],
        initargs: Sequence[Any],
        max_tasks_per_child: Optional[int] = None,
        start: Optional[int] = None,
        name: str = words.POOL,
    ) -> None:
        if start is None or start:
            guard.check_start(name, start_method)  # an unguarded script's start stops here
        #: The pool's name in what it says (``tether.Pool``, ``tether.ProcessPoolExecutor``).
        self.name = name
        self.size = processes
        #: How many slots have a worker: all of them, or ``start`` and those ``grow`` added.
        self.started = processes if start is None else start
        self.number = next(_numbers)
        #: The process that made the pool (a copy inherited through a fork does nothing).
        self.pid = os.getpid()
        self.start_method = start_method
        self.preload = list(preload)
        self.config = {
            "preload": self.preload,
            "initializer": initializer,
            "initargs": tuple(initargs),
            "spin": SPIN,
            "max_tasks": max_tasks_per_child,
        }
        self.workers = _native.WorkerSet(WINDOW, MAX_BATCH, SPIN)
        self.lock = threading.Lock()
        ids = itertools.count(1)
        self.leases = Leases(self.workers, ids, processes, start_method, self)
        self.tasks = Tasks(
            self.workers,
            ids,
            processes,
            max_tasks_per_child,
            self,
            self.leases.free_held_workers,
            name,
        )
        self.replacing: "set[threading.Thread]" = set()
        self.state: State = "running"
        self.broken: Optional[str] = None
        #: Notified by the hub when a worker becomes ready or dies.
        self.changed = threading.Condition(self.lock)
        self.hub: Optional[threading.Thread] = None
        self._begin(wait=start is None)

    def _begin(self, wait: bool) -> None:
        """Starts the workers of the slots started, and the hub; with ``wait``, waits until
        the workers are ready. On any error, the pool is closed before it is raised."""
        try:
            if self.started:
                self._start_workers(list(range(self.started)))
            self.hub = threading.Thread(target=self._hub, name="tether-pool-hub", daemon=True)
            self.hub.start()
            if wait:
                self.wait_ready()
        except BaseException:
            self._close(kill=True)
            if self.hub is not None:
                # It ends at once, the set closed: a daemon thread still coming back from
                # Rust while the interpreter exits would take the process down with it.
                self.hub.join()
            raise

    def wait_ready(self) -> None:
        """Waits until every worker is ready; raises ``BrokenPool`` with the error of a
        worker that died first (its initializer failed, its start did)."""
        self.wait_workers(None)
        if self.broken is not None:
            raise BrokenPool(self.broken)

    def wait_workers(self, timeout: Optional[float]) -> None:
        """Waits (up to ``timeout``) until every worker is ready, or the pool is broken or
        closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.changed:
            while self.broken is None and self.state != "closed":
                workers = self.workers.workers()
                if len(workers) == self.started and all(w.ready for w in workers):
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                self.changed.wait(left)

    # -- workers ---------------------------------------------------------------------------

    def _start_workers(self, slots: List[int]) -> None:
        """Starts the workers of ``slots`` in one launch, each linked to the set."""
        links = [self.workers.link() for _ in slots]
        fds = {slot: link.child_fds() for slot, link in zip(slots, links)}
        # A fork child closes what it inherits of the pool: every worker's socket.
        inherited = self.workers.parent_fds() + [link.parent_fd() for link in links]
        logger.info("pool %d: starting worker(s) %s", self.number, slots)
        group = launch.start(
            worker.serve,
            (fds, self.config),
            slots,
            self.start_method,
            preload=self.preload or None,
            keep_fds=[fd for link in fds.values() for fd in (link.ctl, link.gate)],
            close_in_child=inherited,
            title=(
                f"tether pool {self.number} worker {{rank}} [{self.start_method}, "
                f"parent {os.getpid()}]",
                f"tether:p{self.number}w{{rank}}",
            ),
        )
        for member, (slot, link) in enumerate(zip(slots, links)):
            try:
                self.workers.add(slot, link, group, member)
            except (RuntimeError, OSError):
                # Closed meanwhile (or it cannot be watched): it must not outlive the pool.
                group.signal(member, signal.SIGKILL)
                group.wait([member], _native.WaitFor.ALL, 5.0)

    def grow(self, wanted: int) -> None:
        """Starts workers, without waiting for them, until ``wanted`` slots (at most the
        pool's size) have one. One that cannot be started breaks the pool (the tasks
        queued fail with ``BrokenPool``), as a replacement that cannot be started does."""
        if self.started < min(wanted, self.size):
            guard.check(self.name)
        with self.lock:
            if self.state != "running" or self.broken is not None:
                return
            slots = list(range(self.started, min(wanted, self.size)))
            self.started += len(slots)
        if not slots:
            return
        try:
            self._start_workers(slots)
        except Exception as exc:  # noqa: BLE001 - said in the tasks' BrokenPool
            self._break(f"could not start a worker: {exc!r}")

    def describe(self) -> census.Pool:
        """This pool and its workers, for ``tether.status()``."""
        leased_to = self.leases.leased_to
        workers = [
            census.Child(
                w.pid, f"worker {w.slot}", worker_state(w.ready, leased_to(w.lease), w.reserved)
            )
            for w in self.workers.workers()
        ]
        return census.Pool(self.number, self.start_method, workers)

    # -- what the tasks and the leases ask (``tasks.TaskHost``, ``leases.LeaseHost``) --------

    def check_open(self) -> None:
        if self.broken is not None:
            raise BrokenPool(self.broken)
        if self.state != "running":
            raise RuntimeError("cannot schedule new futures after shutdown")

    def taken(self) -> None:
        if self.state != "running":
            self.workers.wake()  # the hub closes the pool once no work is left

    # -- the hub ---------------------------------------------------------------------------

    def _hub(self) -> None:
        """Takes the worker set's events and delivers them, until the pool is closed."""
        delivery.active = True
        while True:
            events = self.workers.poll(None)
            if events is None:
                return
            try:
                self._handle(events)
                self.leases.send_forgotten()
            except Exception:  # noqa: BLE001 - the hub must outlive any bug of ours
                threading.excepthook(
                    threading.ExceptHookArgs((*sys.exc_info(), threading.current_thread()))
                )
            del events
            if self.state != "running" and not self.workers.busy():
                self._close(kill=False)
                return

    def _handle(self, events: List[_native._WorkerEvent]) -> None:
        for event in events:
            if isinstance(event, _native.WorkerResults):
                self.tasks.on_results(event.results)
            elif isinstance(event, _native.LeaseEnded):
                self.leases.ended(event.slot, event.lease)
            elif isinstance(event, _native.WorkerDied):
                self._on_death(event)
            if isinstance(event, (_native.WorkerReady, _native.WorkerDied)):
                with self.changed:
                    self.changed.notify_all()

    # -- healing ---------------------------------------------------------------------------

    def _on_death(self, death: _native.WorkerDied) -> None:
        """A worker died: fail what it was running, and the results it never sent; start a
        replacement (or, when it died before it was ready, mark the pool broken)."""
        slot, pid, status = death.slot, death.pid, death.status
        logger.info("pool %d: worker %d (pid %d) died with %s", self.number, slot, pid, status)
        if death.lease is not None:
            self.leases.running.pop(death.lease.id, None)
        self.tasks.on_death(death)
        if not death.ready and self.state != "closed" and self.broken is None:
            report = reports.decode(death.report)
            text = None if report is None else report[0]
            if report is not None and isinstance(report[1], guard.MainNotGuardedError):
                self._break(words.main_not_guarded_in_worker(death, str(report[1]), self.name))
            else:
                self._break(words.worker_not_started(death, text, self.name))
        elif self.state != "closed" and self.broken is None:
            thread = threading.Thread(
                target=self._replace, args=(slot,), name="tether-pool-replace", daemon=True
            )
            with self.lock:
                self.replacing.add(thread)
            try:
                thread.start()
            except RuntimeError as exc:  # interpreter shutting down
                with self.lock:
                    self.replacing.discard(thread)
                self._break(f"could not start a replacement worker: {exc!r}")

    def _replace(self, slot: int) -> None:
        try:
            self._start_workers([slot])
            logger.info("pool %d: worker %d replaced", self.number, slot)
        except BaseException as exc:  # noqa: BLE001 - a pool that cannot heal is broken
            self._break(f"could not start a replacement worker: {exc!r}")
        finally:
            with self.lock:
                self.replacing.discard(threading.current_thread())
            self.workers.wake()

    def _break(self, message: str) -> None:
        """Marks the pool broken: every task not started fails with ``BrokenPool``."""
        self.broken = message
        self.tasks.fail(self.workers.cancel_all(), BrokenPool(message))

    # -- shutdown --------------------------------------------------------------------------

    def stop(self, wait: bool, cancel_futures: bool) -> None:
        """``shutdown`` of the pool's faces: no new tasks; with ``cancel_futures`` the
        tasks submitted after the last one started are cancelled (those that run are the
        first ones submitted); every DataLoader iterator's workers are taken back; with
        ``wait``, returns once the pool is closed."""
        with self.lock:
            if self.state == "running":
                self.state = "shutdown"
        if os.getpid() == self.pid:
            # Every DataLoader iterator's workers come back (within GRACE): a loader alive
            # now ends without torch's "killed by signal" (see ``runs``).
            self.leases.take_back_all("the tether.Pool was shut down")
        if cancel_futures:
            # The tasks that run are the first ones submitted, as ProcessPoolExecutor's.
            self.tasks.mark_cancelled(self.workers.cancel_after_started())
        self.workers.wake()
        if wait:
            self.wait_closed()

    def wait_closed(self) -> None:
        """Waits for the hub (which closes the pool once its work is done) and for the
        replacements being started."""
        hub = self.hub
        if hub is not None and hub is not threading.current_thread():
            hub.join()
        self.join_replacements()

    def join_replacements(self) -> None:
        """Waits until the workers being started to replace dead ones are in the set."""
        with self.lock:
            starting = list(self.replacing)
        for thread in starting:
            if thread is not threading.current_thread():
                thread.join()

    def _close(self, kill: bool) -> None:
        """Stops every worker; tasks never answered fail; leases end with their workers'
        status. With ``kill``, workers get SIGKILL at once."""
        with self.lock:
            if self.state == "closed":
                return
            self.state = "closed"
            self.changed.notify_all()
        left = self.workers.close(kill, 0.0 if kill else EXIT_GRACE)
        error = RuntimeError(f"the {self.name} was shut down before this task ran")
        self.tasks.fail(left, error)
        self.tasks.fail_all(error)
        self.leases.running.clear()
        _live.discard(self)


_live: "weakref.WeakSet[Core]" = weakref.WeakSet()
#: Numbers the pools of this process (as they show in ``ps`` and ``tether.status()``).
_numbers = itertools.count(1)


def track(core: Core) -> None:
    """Counts ``core`` among the live pools (``tether.status()``, the interpreter's exit)."""
    _live.add(core)


def describe_pools() -> List[census.Pool]:
    """The pools of this process and their workers (see ``tether.status()``)."""
    return [core.describe() for core in sorted(_live, key=lambda c: c.number)]


def worker_stacks(timeout: float) -> List[Any]:
    """``[(pid, text)]``: the stack of every worker of this process's pools, asked at once
    within ``timeout`` seconds. Tether's handler of a stack request calls it, so that the
    workers of a pool that a rank started show under the rank in ``tether stacks``: they
    answer to the pools' process, not to the launcher."""
    targets = [m for core in list(_live) if core.pid == os.getpid() for m in core.workers.members()]
    if not targets:
        return []
    return [(a.pid, a.text) for a in stacks.ask(targets, timeout, False)]


def _python_exit() -> None:
    """At interpreter exit, before threads are joined: every pool finishes the work it was
    given (as ``ProcessPoolExecutor`` does), then stops."""
    for core in list(_live):
        if core.pid == os.getpid():
            core.leases.free_held_workers()
            core.stop(wait=True, cancel_futures=False)


census.add_pools(describe_pools)

try:
    # What concurrent.futures registers its own exit hook with (private to threading, not in
    # its type stubs): it runs before non-daemon threads are joined.
    threading._register_atexit(_python_exit)  # type: ignore[attr-defined]
except RuntimeError:  # imported while the interpreter shuts down
    pass
