"""``tether.Pool``: long-lived worker processes that many DataLoaders borrow in turn or at the
same time (``DataLoader(..., multiprocessing_context=pool.context())``), and a
``concurrent.futures.Executor`` over the same workers.

Each worker is a direct child of this process, started by the tether supervisor (so it leads
its own process group and dies with this process), and is linked to the pool by a control
socket (a ``SOCK_SEQPACKET`` pair). One hub thread waits on every control socket with epoll:
it collects results, notes when a leased process ends, and sees a worker die the moment its
socket closes; it then fails exactly the task that was running (the worker writes the id of
the task it runs to a shared page), runs the tasks the worker never started elsewhere, and
starts a replacement.

Executor tasks are pickled in ``submit`` (errors land on the future), queued, and sent to idle
workers in batches whose size follows the backlog (one task when the pool is idle, up to
``MAX_BATCH`` under a long ``map``), at most ``WINDOW`` messages per worker in flight.
A leased process (``pool.context().Process``) takes a worker for itself until its target
returns; executor tasks go to the other workers meanwhile."""

from __future__ import annotations

import concurrent.futures
import gc
import inspect
import itertools
import os
import signal
import sys
import threading
import time
import weakref
from collections import deque
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Deque,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
)

from . import _channel, _launch, _native, _report, _worker

if TYPE_CHECKING:
    from . import _status
    from .context import PoolContext, PoolProcess

__all__ = ["BrokenPool", "NoFreeWorkerError", "Pool", "WorkerCrashedError"]

#: Messages of executor tasks in flight per worker (one running, one waiting in its socket).
WINDOW = 2
#: The most tasks one message carries.
MAX_BATCH = 256
#: After a message, the hub (and a worker) poll this long before sleeping: the answer to a
#: task is often that close, and a sleeping thread costs a wake-up (tens of microseconds).
SPIN = 0.0002
#: How long shutdown waits for workers to exit after closing their sockets, before SIGKILL.
EXIT_GRACE = 2.0


class WorkerCrashedError(RuntimeError):
    """A pool worker died while it ran (or had just run) a task. ``pid`` is the worker's,
    ``exitcode`` its exit code (minus the signal number when killed), ``signal_name`` the
    signal's name (``SIGSEGV``) or None."""

    def __init__(
        self, message: str, pid: int, exitcode: int, signal_name: Optional[str] = None
    ) -> None:
        super().__init__(message)
        self.pid = pid
        self.exitcode = exitcode
        self.signal_name = signal_name

    def __reduce__(self):  # type: ignore[override]
        return type(self), (self.args[0], self.pid, self.exitcode, self.signal_name)


class NoFreeWorkerError(RuntimeError):
    """No worker is free for a leased process (a RuntimeError for the caller)."""


class BrokenPool(concurrent.futures.BrokenExecutor):
    """The pool cannot run tasks: a worker failed to start (its error is in the message)."""


class _RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker (the ``__cause__`` of the exception
    re-raised here, as in ``concurrent.futures``)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n\n" + self.text


def _status_text(exitcode: int) -> Tuple[str, Optional[str], Optional[str]]:
    """("killed by signal SIGSEGV (Segmentation fault)" or "exited with code 3", the
    signal's name, a hint)."""
    if exitcode < 0:
        name = _native.signal_name(-exitcode)
        try:
            description = signal.strsignal(-exitcode)
        except ValueError:
            description = None
        text = f"killed by signal {name}" + (f" ({description})" if description else "")
        return text, name, _native.signal_hint(-exitcode)
    return f"exited with code {exitcode}", None, None


_PENDING = object()


class _MapRun:
    """The results of one ``map`` call, filled by the hub, read in order by its iterator."""

    __slots__ = ("results", "cond", "cancelled", "__weakref__")

    def __init__(self, size: int) -> None:
        self.results: List[Any] = [_PENDING] * size
        self.cond = threading.Condition()
        self.cancelled = False

    def deliver(self, outcomes: Sequence[Tuple[int, bool, Any]]) -> None:
        with self.cond:
            for index, ok, value in outcomes:
                self.results[index] = (ok, value)
            self.cond.notify_all()

    def take(self, index: int, deadline: Optional[float]) -> Tuple[bool, Any]:
        with self.cond:
            while self.results[index] is _PENDING:
                if deadline is None:
                    self.cond.wait()
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise concurrent.futures.TimeoutError()
                    self.cond.wait(left)
            outcome, self.results[index] = self.results[index], None
        return outcome  # type: ignore[no-any-return]


Sink = Union[concurrent.futures.Future, _MapRun]


class _Item:
    """One executor task: its pickled call, the fds that go with it (duplicates owned here),
    and where its outcome goes."""

    __slots__ = ("id", "blob", "fds", "sink", "index")

    def __init__(self, item_id: int, blob: bytes, fds: List[int], sink: Sink, index: int) -> None:
        self.id = item_id
        self.blob = blob
        self.fds = fds
        self.sink = sink
        self.index = index

    def cancelled(self) -> bool:
        sink = self.sink
        if isinstance(sink, _MapRun):
            return sink.cancelled
        return sink.cancelled()


class _Sent:
    """A message in flight to a worker: a batch of tasks (``pos`` counts those answered) or
    a leased process."""

    __slots__ = ("items", "pos", "process")

    def __init__(self, items: Optional[List[_Item]] = None, process: Any = None) -> None:
        self.items = items
        self.pos = 0
        self.process = process


class _Worker:
    """One worker process as the pool sees it."""

    __slots__ = (
        "slot",
        "pid",
        "group",
        "ctl",
        "token",
        "progress",
        "inflight",
        "lease",
        "reserved",
        "ready",
        "dead",
        "final",
    )

    def __init__(
        self,
        slot: int,
        pid: int,
        group: _native.Group,
        ctl: _native.Endpoint,
        token: int,
        progress: _worker.Progress,
    ) -> None:
        self.slot = slot
        self.pid = pid
        self.group = group
        self.ctl = ctl
        self.token = token
        self.progress = progress
        self.inflight: Deque[_Sent] = deque()
        self.lease: Optional["PoolProcess"] = None
        self.reserved = False
        self.ready = False
        self.dead = False
        self.final: Optional[_native.ExitStatus] = None

    def exit(self) -> Optional[_native.ExitStatus]:
        """None while the process runs, else its status (as ``_native.Group.exit``)."""
        group = self.group
        return self.final if group is None else group.exit(0)

    def release(self) -> None:
        """Once the process has exited: keep its status, drop its pidfd and mapping."""
        if self.group is not None and self.final is None:
            self.final = self.group.exit(0)
        self.group = None  # type: ignore[assignment]
        self.progress.close()


_signatures: Dict[Any, Optional[inspect.Signature]] = {}


def _dataloader_call(
    target: Any, args: Sequence[Any], kwargs: Dict[str, Any]
) -> Optional[Dict[str, Any]]:
    """The arguments of torch's DataLoader worker loop, by name, when ``target`` is it."""
    if getattr(target, "__name__", None) != "_worker_loop" or not str(
        getattr(target, "__module__", "")
    ).startswith("torch.utils.data"):
        return None
    if target not in _signatures:
        try:
            _signatures[target] = inspect.signature(target)
        except (TypeError, ValueError):
            _signatures[target] = None
    sig = _signatures[target]
    if sig is None:
        return None
    try:
        bound = sig.bind(*args, **kwargs).arguments
    except TypeError:
        return None
    if "worker_id" not in bound or "num_workers" not in bound:
        return None
    return dict(bound)


class _Core:
    """The pool's state, shared by the ``Pool`` façade, its contexts, the hub thread and the
    finalizer (none of which keeps the façade alive)."""

    def __init__(
        self,
        processes: int,
        start_method: str,
        preload: Sequence[str],
        initializer: Optional[Callable[..., Any]],
        initargs: Sequence[Any],
    ) -> None:
        self.size = processes
        self.start_method = start_method
        self.preload = list(preload)
        self.initializer = initializer
        self.initargs = tuple(initargs)
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.workers: List[Optional[_Worker]] = [None] * processes
        self.by_token: Dict[int, _Worker] = {}
        self.pending: Deque[_Item] = deque()
        self.ids = itertools.count(1)
        self.tokens = itertools.count(1)
        self.state = "running"  # "shutdown" (no new tasks), "closed"
        self.broken: Optional[str] = None
        self.poller = _native.Poller()
        self.hub: Optional[threading.Thread] = None
        try:
            for slot in range(processes):
                self._add_worker(self._start_worker(slot))
        except BaseException:
            self.close(kill=True)
            raise
        self.hub = threading.Thread(target=self._hub, name="tether-pool-hub", daemon=True)
        self.hub.start()

    # -- workers ---------------------------------------------------------------------------

    def _config(self) -> Dict[str, Any]:
        return {"preload": self.preload, "initializer": self.initializer, "initargs": self.initargs}

    def _start_worker(self, slot: int) -> _Worker:
        """Starts the worker of ``slot``, linked to the pool by a control socket and a
        progress page."""
        ours, theirs = _native.Endpoint.pair()
        progress = _worker.Progress.create()
        try:
            child_fd = theirs.fileno()
            assert progress.fd is not None
            # A fork child closes what it inherits of the pool: every worker's socket.
            inherited = [w.ctl.fileno() for w in self.workers if w is not None and not w.ctl.closed]
            group = _launch.start(
                _worker.serve,
                (child_fd, progress.fd, self._config()),
                [slot],
                self.start_method,
                preload=self.preload or None,
                keep_fds=[child_fd, progress.fd],
                close_in_child=[*inherited, ours.fileno()],
            )
        except BaseException:
            ours.close()
            progress.close()
            raise
        finally:
            theirs.close()
            progress.close_fd()
        return _Worker(slot, group.pid(0), group, ours, next(self.tokens), progress)

    def _add_worker(self, worker: _Worker) -> None:
        self.workers[worker.slot] = worker
        self.by_token[worker.token] = worker
        self.poller.add(worker.token, worker.ctl.fileno())

    def pids(self) -> List[int]:
        with self.lock:
            return [w.pid for w in self.workers if w is not None and not w.dead]

    # -- executor --------------------------------------------------------------------------

    def check_open(self) -> None:
        if self.broken is not None:
            raise BrokenPool(self.broken)
        if self.state != "running":
            raise RuntimeError("cannot schedule new futures after shutdown")

    def make_item(
        self,
        fn: Callable[..., Any],
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
        sink: Sink,
        index: int,
    ) -> Optional[_Item]:
        """Pickles a task; on failure its error goes to the sink and None is returned."""
        collector = _channel._FdCollector(dup=True)
        try:
            blob = _channel.dumps((fn, args, kwargs), collector)
        except BaseException as exc:  # noqa: BLE001 - SystemExit in a __reduce__ included
            collector.close()
            error = _pickling_error(exc)
            _deliver([(sink, index, False, error)])
            return None
        return _Item(next(self.ids), blob, collector.fds, sink, index)

    def enqueue(self, items: Iterable[_Item]) -> None:
        with self.lock:
            self.check_open()
            self.pending.extend(items)
            self._dispatch_locked()

    def _dispatch_locked(self) -> None:
        """Sends queued tasks to the least busy workers with room, in batches sized to the
        backlog (one task when the pool is idle, up to ``MAX_BATCH`` under a long map)."""
        pending = self.pending
        while pending:
            best: Optional[_Worker] = None
            for w in self.workers:
                if w is None or w.dead or w.lease is not None or w.reserved:
                    continue
                n = len(w.inflight)
                if n < WINDOW and (best is None or n < len(best.inflight)):
                    best = w
                    if n == 0:
                        break
            if best is None:
                return
            size = min(MAX_BATCH, max(1, -(-len(pending) // (WINDOW * self.size))))
            batch: List[_Item] = []
            while pending and len(batch) < size:
                item = pending.popleft()
                sink = item.sink
                if isinstance(sink, _MapRun):
                    if sink.cancelled:
                        _close_fds(item)
                        continue
                elif not sink.running() and not sink.set_running_or_notify_cancel():
                    _close_fds(item)  # cancelled while queued (a requeued task is running)
                    continue
                batch.append(item)
            if not batch:
                continue
            data, fds = _worker.encode_batch([(i.id, i.blob, i.fds) for i in batch])
            best.inflight.append(_Sent(items=batch))
            try:
                best.ctl.send(data, fds)
            except (OSError, ValueError):
                pass  # the worker is dying: the hub runs elsewhere what it never started

    def _busy_locked(self) -> bool:
        return bool(self.pending) or any(
            w is not None and not w.dead and any(s.items is not None for s in w.inflight)
            for w in self.workers
        )

    # -- leased processes ------------------------------------------------------------------

    def lease(
        self, process: "PoolProcess", target: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> _Worker:
        """Starts ``process``: pickles its call (passing the fds it names), takes a worker
        for it (for a DataLoader's first worker, as many as the loader has workers, or a
        clear error), and sends it there."""
        collector = _channel._FdCollector()
        blob = _channel.dumps((target, args, kwargs), collector)
        loader = _dataloader_call(target, args, kwargs)
        process._describe = _describe_call(target, loader)
        process._dataloader = loader is not None
        for attempt in (1, 2):
            try:
                self._lease_locked_send(process, loader, blob, collector)
                break
            except NoFreeWorkerError:
                if attempt == 2:
                    raise
                # An iterator that is garbage but not yet collected (in a reference cycle
                # with the traceback of an error it raised) still holds workers: collect it
                # (its __del__ gives them back) and try once more.
                gc.collect()
        for channel in collector.channels:
            if isinstance(channel, _channel.Queue):
                channel._watch.append(process)
        assert process._worker_for_start is not None
        return process._worker_for_start

    def _lease_locked_send(
        self,
        process: "PoolProcess",
        loader: Optional[Dict[str, Any]],
        blob: bytes,
        collector: _channel._FdCollector,
    ) -> None:
        with self.lock:
            if self.broken is not None:
                raise BrokenPool(self.broken)
            if self.state == "closed":
                raise RuntimeError("the tether.Pool is shut down")
            worker = self._take_for_lease_locked(process, loader)
            process._lease_id = next(self.ids)
            worker.lease = process
            worker.reserved = False
            worker.inflight.append(_Sent(process=process))
            try:
                worker.ctl.send(_worker.encode_lease(process._lease_id, blob), collector.fds)
            except (OSError, ValueError):
                pass  # the worker is dying: the hub fails this process with its status
            process._worker_for_start = worker

    def _free_locked(self) -> List[_Worker]:
        free = [
            w
            for w in self.workers
            if w is not None and not w.dead and w.lease is None and not w.reserved
        ]
        free.sort(key=lambda w: len(w.inflight))
        return free

    def _take_for_lease_locked(
        self, process: "PoolProcess", loader: Optional[Dict[str, Any]]
    ) -> _Worker:
        if loader is not None:
            done_event = loader.get("done_event")
            reserved: Optional[List[_Worker]] = getattr(done_event, "_tether_reserved", None)
            if loader["worker_id"] > 0 and reserved:
                while reserved:
                    worker = reserved.pop(0)
                    if not worker.dead and worker.lease is None:
                        return worker
            need = max(1, int(loader["num_workers"]) - int(loader["worker_id"]))
            free = self._free_locked()
            if len(free) < need:
                raise NoFreeWorkerError(
                    self._exhausted(need, int(loader["num_workers"]), len(free))
                )
            chosen = free[:need]
            for worker in chosen[1:]:
                worker.reserved = True
            if done_event is not None and need > 1:
                rest = chosen[1:]
                try:
                    done_event._tether_reserved = rest
                    weakref.finalize(done_event, self._release, rest)
                except (AttributeError, TypeError):
                    self._release(rest)
            return chosen[0]
        free = self._free_locked()
        if not free:
            raise NoFreeWorkerError(self._exhausted(1, None, 0))
        return free[0]

    def _release(self, workers: List[_Worker]) -> None:
        """Gives back reserved workers that a DataLoader never started."""
        with self.lock:
            for worker in workers:
                worker.reserved = False
            workers.clear()
            self._dispatch_locked()

    def _exhausted(self, need: int, num_workers: Optional[int], free: int) -> str:
        what = (
            f"a DataLoader with num_workers={num_workers}"
            if num_workers is not None
            else "a process"
        )
        leases: Dict[str, List[int]] = {}
        reserved = 0
        for w in self.workers:
            if w is None or w.dead:
                continue
            if w.lease is not None:
                leases.setdefault(w.lease._describe, []).append(w.pid)
            elif w.reserved:
                reserved += 1
        held = sum(len(p) for p in leases.values())
        lines = [
            f"tether.Pool(processes={self.size}) cannot lease {need} worker(s) for {what}: "
            f"only {free} of its {self.size} workers are free; {held} are leased"
            + (f" and {reserved} reserved by a DataLoader being started" if reserved else "")
            + (":" if leases else ".")
        ]
        for description, pids in leases.items():
            lines.append(f"  - {len(pids)} by {description} (pid {', '.join(map(str, pids))})")
        lines.append(
            "A DataLoader iterator keeps its workers until it is exhausted or deleted (with "
            "persistent_workers, until the loader is deleted). Make the pool larger, lower "
            "num_workers, or finish the other iterations first."
        )
        return "\n".join(lines)

    # -- the hub ---------------------------------------------------------------------------

    def _hub(self) -> None:
        spin = 0.0
        while True:
            try:
                tokens = self.poller.wait(None, spin)
            except (OSError, ValueError):
                return  # closed under us
            spin = SPIN
            if self.state == "closed":
                return
            for token in tokens:
                worker = self.by_token.get(token)
                if worker is None or worker.dead:
                    continue
                try:
                    self._drain(worker)
                except Exception:  # noqa: BLE001 - the hub must outlive any bug of ours
                    threading.excepthook(
                        threading.ExceptHookArgs(  # type: ignore[call-arg]
                            (*sys.exc_info(), threading.current_thread())
                        )
                    )
            if self.state == "shutdown":
                with self.lock:
                    finished = not self._busy_locked()
                    self.idle.notify_all()
                if finished and self._closing_when_idle:
                    self.close(kill=False)
                    return

    _closing_when_idle = False

    def _drain(self, worker: _Worker) -> None:
        while True:
            try:
                got = worker.ctl.recv(0.0)
            except EOFError:
                self._on_death(worker)
                return
            except (OSError, ValueError):
                return
            if got is None:
                return
            data, fds = got
            kind = data[:1]
            if kind == _worker.RESULTS:
                self._on_results(worker, data, fds)
            elif kind == _worker.DONE:
                _channel._close_all(fds)
                self._on_done(worker, *_worker.decode_done(data))
            elif kind == _worker.HELLO:
                _channel._close_all(fds)
                worker.ready = True

    def _on_results(self, worker: _Worker, data: bytes, fds: List[int]) -> None:
        answered: List[Tuple[_Item, bool, memoryview, List[int]]] = []
        with self.lock:
            for task_id, ok, blob, result_fds in _worker.decode_results(data, fds):
                sent = worker.inflight[0] if worker.inflight else None
                if sent is None or sent.items is None or sent.items[sent.pos].id != task_id:
                    _channel._close_all(result_fds)
                    continue
                answered.append((sent.items[sent.pos], ok, blob, result_fds))
                sent.pos += 1
                if sent.pos == len(sent.items):
                    worker.inflight.popleft()
            self._dispatch_locked()
            if self.state != "running":
                self.idle.notify_all()
        outcomes = []
        for item, ok, blob, result_fds in answered:
            _close_fds(item)
            try:
                value = _channel.loads(blob, result_fds)
            except BaseException as exc:  # noqa: BLE001 - SystemExit while unpickling too
                ok, value = False, _unpickling_result_error(exc, worker.pid)
            else:
                if not ok:
                    exc, text = value
                    exc.__cause__ = _RemoteTraceback(text)
                    value = exc
            outcomes.append((item.sink, item.index, ok, value))
        _deliver(outcomes)

    def _on_done(self, worker: _Worker, lease_id: int, code: int) -> None:
        with self.lock:
            sent = worker.inflight[0] if worker.inflight else None
            process = None
            if sent is not None and sent.process is not None and sent.process._lease_id == lease_id:
                worker.inflight.popleft()
                process = sent.process
                if worker.lease is process:
                    worker.lease = None
            self._dispatch_locked()
        if process is not None:
            process._finish(code)

    def _on_death(self, worker: _Worker) -> None:
        """A worker's socket closed: it died. Fail what it was running, run elsewhere what
        it never started, and start a replacement (or mark the pool broken when it died
        before it was ready)."""
        try:
            self.poller.remove(worker.ctl.fileno())
        except (OSError, ValueError):
            pass
        worker.ctl.close()
        worker.group.wait(None, "all", 10.0)
        status = worker.exit()
        exitcode = 255 if status is None or status.exitcode is None else status.exitcode
        running = worker.progress.get()
        report = worker.group.report(0)
        failed: List[Tuple[Sink, int, bool, Any]] = []
        processes: List[Tuple["PoolProcess", int]] = []
        requeue: List[_Item] = []
        startup_error = None
        with self.lock:
            worker.dead = True
            self.by_token.pop(worker.token, None)
            found = False
            for sent in worker.inflight:
                if sent.process is not None:
                    processes.append((sent.process, exitcode))
                    if sent.process._lease_id == running:
                        found = True
                    continue
                assert sent.items is not None
                unanswered = sent.items[sent.pos :]
                ids = [i.id for i in unanswered]
                if not found and running in ids:
                    at = ids.index(running)
                    for item in unanswered[:at]:
                        failed.append(self._crash(item, worker.pid, exitcode, lost=True))
                    failed.append(self._crash(unanswered[at], worker.pid, exitcode, lost=False))
                    requeue.extend(unanswered[at + 1 :])
                    found = True
                else:
                    requeue.extend(unanswered)
            worker.inflight.clear()
            worker.lease = None
            worker.release()
            if not worker.ready and self.state == "running" and self.broken is None:
                startup_error = self._startup_failure(worker, exitcode, report)
                self.broken = startup_error
            if self.broken is not None:
                for item in requeue + list(self.pending):
                    failed.append((item.sink, item.index, False, BrokenPool(self.broken)))
                    _close_fds(item)
                self.pending.clear()
            else:
                self.pending.extendleft(reversed(requeue))
            replace = self.state == "running" and self.broken is None
        if replace:
            try:
                fresh = self._start_worker(worker.slot)
            except BaseException as exc:  # noqa: BLE001 - a pool that cannot heal is broken
                with self.lock:
                    self.broken = f"could not start a replacement worker: {exc!r}"
            else:
                with self.lock:
                    closed = self.state == "closed"
                    if not closed:
                        self._add_worker(fresh)
                if closed:  # shut down meanwhile: this one must not outlive the pool
                    fresh.ctl.close()
                    fresh.group.signal(0, signal.SIGKILL)
                    fresh.group.wait(None, "all", 5.0)
                    fresh.release()
        with self.lock:
            self._dispatch_locked()
            self.idle.notify_all()
        for process, code in processes:
            process._finish(code, died=True)
        _deliver(failed)

    def _crash(
        self, item: _Item, pid: int, exitcode: int, lost: bool
    ) -> Tuple[Sink, int, bool, Any]:
        text, name, hint = _status_text(exitcode)
        when = (
            "after running this task, before its result was sent back"
            if lost
            else "while running this task"
        )
        error = WorkerCrashedError(
            f"tether.Pool worker (pid {pid}) {text} {when}"
            + (f" ({hint})" if hint else "")
            + "; the pool started a new worker",
            pid,
            exitcode,
            name,
        )
        _close_fds(item)
        return item.sink, item.index, False, error

    def _startup_failure(self, worker: _Worker, exitcode: int, raw_report: bytes) -> str:
        report = _report.decode(raw_report)
        text, _, _ = _status_text(exitcode)
        message = f"a tether.Pool worker (pid {worker.pid}) {text} before it was ready"
        if report is not None:
            message += ":\n" + report[0]
        return message

    # -- shutdown --------------------------------------------------------------------------

    def shutdown(self, wait: bool, cancel_futures: bool) -> None:
        cancelled: List[_Item] = []
        with self.lock:
            if self.state == "running":
                self.state = "shutdown"
            if cancel_futures:
                cancelled = list(self.pending)
                self.pending.clear()
        for item in cancelled:
            _close_fds(item)
            if isinstance(item.sink, concurrent.futures.Future):
                item.sink.cancel()
            else:
                item.sink.cancelled = True
        if not wait:
            self._closing_when_idle = True
            self.poller.wake()
            return
        with self.lock:
            while self._busy_locked() and self.state != "closed":
                self.idle.wait(0.1)
        self.close(kill=False)

    def close(self, kill: bool) -> None:
        """Stops every worker and the hub, and frees everything. Work still queued fails;
        leased processes end with their worker's status. With ``kill``, workers get SIGKILL
        at once (interpreter exit, garbage collection)."""
        with self.lock:
            if self.state == "closed":
                return
            self.state = "closed"
            workers = [w for w in self.workers if w is not None and w.group is not None]
            left = list(self.pending)
            self.pending.clear()
            for w in workers:
                for sent in w.inflight:
                    if sent.items is not None:
                        left.extend(sent.items[sent.pos :])
                w.inflight.clear()
            self.idle.notify_all()
        self.poller.wake()
        hub = self.hub
        if hub is not None and hub is not threading.current_thread():
            hub.join(5.0)
        for w in workers:
            if w.lease is not None or kill:
                w.group.signal(0, signal.SIGKILL)
            w.ctl.close()
        deadline = time.monotonic() + (0.0 if kill else EXIT_GRACE)
        for w in workers:
            if not w.group.wait(None, "all", max(0.0, deadline - time.monotonic())):
                w.group.signal(0, signal.SIGKILL)
                w.group.wait(None, "all", 5.0)
            if w.lease is not None:
                status = w.exit()
                code = None if status is None else status.exitcode
                w.lease._finish(-signal.SIGKILL if code is None else code, died=True)
                w.lease = None
            w.release()
        with self.lock:
            self.workers = [None] * self.size
            self.by_token.clear()
        self.poller.close()
        error = RuntimeError("the tether.Pool was shut down before this task ran")
        outcomes = []
        for item in left:
            _close_fds(item)
            outcomes.append((item.sink, item.index, False, error))
        _deliver(outcomes)
        _live.discard(self)


def _close_fds(item: _Item) -> None:
    if item.fds:
        _channel._close_all(item.fds)
        item.fds = []


def _pickling_error(exc: BaseException) -> BaseException:
    import pickle

    error = pickle.PicklingError(f"Could not pickle the task to send it to the workers: {exc!r}")
    error.__cause__ = exc
    return error


def _unpickling_result_error(exc: BaseException, pid: int) -> BaseException:
    error = RuntimeError(
        f"could not unpickle the result of a task from worker (pid {pid}): {exc!r}"
    )
    error.__cause__ = exc
    return error


def _describe_call(target: Any, loader: Optional[Dict[str, Any]]) -> str:
    if loader is not None:
        holder = loader.get("dataset_holder", loader.get("dataset"))
        dataset = holder[0] if isinstance(holder, list) and holder else holder
        return f"DataLoader iterator(s) over {type(dataset).__name__}"
    name = getattr(target, "__qualname__", None) or repr(target)
    return f"process(es) running {getattr(target, '__module__', '?')}.{name}"


def _deliver(outcomes: Sequence[Tuple[Sink, int, bool, Any]]) -> None:
    """Hands outcomes to their futures and map runs (never under the pool's lock)."""
    runs: Dict[int, Tuple[_MapRun, List[Tuple[int, bool, Any]]]] = {}
    for sink, index, ok, value in outcomes:
        if isinstance(sink, _MapRun):
            runs.setdefault(id(sink), (sink, []))[1].append((index, ok, value))
            continue
        if sink.done():
            continue
        try:
            if ok:
                sink.set_result(value)
            else:
                sink.set_exception(value)
        except concurrent.futures.InvalidStateError:
            pass
    for run, batch in runs.values():
        run.deliver(batch)


_live: "weakref.WeakSet[_Core]" = weakref.WeakSet()


def _run_chunk(fn: Callable[..., Any], chunk: Sequence[Tuple[Any, ...]]) -> List[Any]:
    return [fn(*args) for args in chunk]


class Pool(concurrent.futures.Executor):
    """Long-lived worker processes for DataLoaders and for ``concurrent.futures`` work.

    ``processes`` workers (default: the CPU count) are started at once with
    ``start_method`` ("forkserver", the default: forks of tether's zygote, which preloads
    ``preload`` when given; "spawn"; or "fork"); each imports the modules in ``preload``
    and runs ``initializer(*initargs)`` first. ``pool.context()`` is a
    multiprocessing context for ``DataLoader(multiprocessing_context=...)`` whose processes
    are leased pool workers; ``submit`` / ``map`` run tasks on the free workers.
    ``shutdown()`` (or leaving a ``with`` block) stops everything; a pool that is garbage
    collected or still open at interpreter exit is stopped too."""

    def __init__(
        self,
        processes: Optional[int] = None,
        *,
        start_method: Optional[str] = None,
        preload: Optional[Sequence[str]] = None,
        initializer: Optional[Callable[..., Any]] = None,
        initargs: Sequence[Any] = (),
    ) -> None:
        if processes is None:
            processes = os.cpu_count() or 1
        if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
            raise ValueError(f"processes must be a positive int, got {processes!r}")
        method = _launch.DEFAULT_START_METHOD if start_method is None else start_method
        _launch.check_start_method(method, "tether.Pool")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be callable")
        self._core = _Core(processes, method, list(preload or ()), initializer, initargs)
        _live.add(self._core)
        self._finalizer = weakref.finalize(self, self._core.close, True)
        self._context: Optional["PoolContext"] = None

    @property
    def processes(self) -> int:
        """How many workers the pool keeps."""
        return self._core.size

    @property
    def start_method(self) -> str:
        return self._core.start_method

    @property
    def preload(self) -> List[str]:
        return list(self._core.preload)

    def context(self) -> "PoolContext":
        """A ``multiprocessing`` context whose ``Process`` runs in a leased pool worker and
        whose ``Queue`` and ``Event`` are tether channels: pass it as a DataLoader's
        ``multiprocessing_context``."""
        if self._context is None:
            from .context import PoolContext

            self._context = PoolContext(self._core)
        return self._context

    def pids(self) -> List[int]:
        """The pids of the current workers (a replaced worker has a new pid)."""
        return self._core.pids()

    def stacks(self, timeout: float = 5.0, native: bool = False) -> Dict[int, str]:
        """Where every worker is: ``{pid: text}``, as ``ProcessContext.stacks`` has it."""
        from . import _stacks

        core = self._core
        with core.lock:
            live = [w for w in core.workers if w is not None and not w.dead]
            targets = [(w.group, 0) for w in live if w.group is not None]
        return {pid: text for pid, _, text in _stacks.ask(targets, timeout, native)}

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future:
        """Runs ``fn(*args, **kwargs)`` in a free worker; returns its future. A worker that
        dies while running it fails the future with ``WorkerCrashedError``."""
        core = self._core
        core.check_open()
        future: concurrent.futures.Future = concurrent.futures.Future()
        item = core.make_item(fn, args, kwargs, future, 0)
        if item is not None:
            try:
                core.enqueue((item,))
            except BaseException:
                _close_fds(item)
                raise
        return future

    def map(
        self,
        fn: Callable[..., Any],
        *iterables: Iterable[Any],
        timeout: Optional[float] = None,
        chunksize: int = 1,
    ) -> Iterator[Any]:
        """Like ``concurrent.futures.Executor.map``: the results of ``fn`` over the zipped
        iterables, in order; the tasks are all queued now and travel to the workers in
        batches. Leaving the iterator early cancels what has not started."""
        if chunksize < 1:
            raise ValueError("chunksize must be >= 1.")
        core = self._core
        core.check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        calls = list(zip(*iterables))
        if chunksize > 1:
            units: List[Tuple[Callable[..., Any], Tuple[Any, ...]]] = [
                (_run_chunk, (fn, calls[i : i + chunksize]))
                for i in range(0, len(calls), chunksize)
            ]
        else:
            units = [(fn, args) for args in calls]
        run = _MapRun(len(units))
        items = []
        for index, (call, args) in enumerate(units):
            item = core.make_item(call, args, {}, run, index)
            if item is not None:
                items.append(item)
        core.enqueue(items)
        return self._results(run, len(units), chunksize > 1, deadline)

    @staticmethod
    def _results(
        run: _MapRun, count: int, chunked: bool, deadline: Optional[float]
    ) -> Iterator[Any]:
        try:
            for index in range(count):
                ok, value = run.take(index, deadline)
                if not ok:
                    raise value
                if chunked:
                    yield from value
                else:
                    yield value
        finally:
            run.cancelled = True

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stops the pool: no new tasks; with ``cancel_futures`` the queued ones are
        cancelled; with ``wait`` this returns once the running ones are done and every
        worker has exited (otherwise that happens in the background). Workers still leased
        to a DataLoader are killed."""
        self._core.shutdown(wait, cancel_futures)
        if wait:
            self._finalizer.detach()

    def __repr__(self) -> str:
        core = self._core
        return (
            f"<tether.Pool processes={core.size} start_method={core.start_method!r} "
            f"state={core.state}>"
        )


def status() -> List["_status.Pool"]:
    """The pools of this process and their workers (see ``tether.status()``)."""
    from . import _status

    found = []
    for number, core in enumerate(sorted(_live, key=id), start=1):
        with core.lock:
            workers = [
                _status.Child(w.pid, f"worker {w.slot}", _worker_state(w))
                for w in core.workers
                if w is not None and not w.dead
            ]
        found.append(_status.Pool(number, core.start_method, workers))
    return found


def _worker_state(worker: _Worker) -> str:
    if worker.lease is not None:
        return f"leased to {worker.lease._describe or 'a process'}"
    return "busy" if worker.inflight else "idle"
