"""How ``tether.Pool`` lends its workers to processes (a DataLoader's, through
``pool.context()``): which worker a process gets (a DataLoader's first worker reserves as
many as the loader has, or fails with an error that names who holds them), what travels to
it (the call; for torch's DataLoader worker loop, the dataset, ``collate_fn`` and
``worker_init_fn`` as the pool's dataset cache, ``datasets.Kept``, decides), the
DataLoader iterators' runs (``runs``: the workers of one whose last ``next()`` raised
are taken back when a task or another loader waits for a worker; every run's, when the
pool shuts down), and what the pool says of the leases it made."""

from __future__ import annotations

import gc
import inspect
import itertools
import signal
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from tether import _native
from tether.common import pickling
from tether.errors import NoFreeWorkerError

from . import channel, datasets, recycle, runs, shipment
from .errors import BrokenPool
from .loader import Leased
from .runs import Run

#: torch's worker loop -> its signature, and its parameters' names when each may be given by
#: position (no ``*``, ``**`` or keyword-only one); None where it has no signature.
_signatures: Dict[Any, Optional[Tuple[inspect.Signature, Optional[Tuple[str, ...]]]]] = {}


def dataloader_call(
    target: Any, args: Sequence[Any], kwargs: Dict[str, Any]
) -> Optional[Dict[str, Any]]:
    """The arguments of torch's DataLoader worker loop, by name, when ``target`` is it."""
    if getattr(target, "__name__", None) != "_worker_loop" or not str(
        getattr(target, "__module__", "")
    ).startswith("torch.utils.data"):
        return None
    if target not in _signatures:
        _signatures[target] = _signature(target)
    known = _signatures[target]
    if known is None:
        return None
    sig, names = known
    if names is not None and not kwargs and len(args) <= len(names):
        bound = dict(zip(names, args))  # what bind() gives, without its cost per worker
    else:
        try:
            bound = sig.bind(*args, **kwargs).arguments
        except TypeError:
            return None
    if "worker_id" not in bound or "num_workers" not in bound:
        return None
    return dict(bound)


def _signature(target: Any) -> Optional[Tuple[inspect.Signature, Optional[Tuple[str, ...]]]]:
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    kinds = {p.kind for p in sig.parameters.values()}
    plain = kinds <= {inspect.Parameter.POSITIONAL_OR_KEYWORD}
    return sig, (tuple(sig.parameters) if plain else None)


def _need(loader: Optional[Dict[str, Any]]) -> int:
    """How many workers a process asks for: a DataLoader's first worker, all of them."""
    if loader is None:
        return 1
    return max(1, int(loader["num_workers"]) - int(loader["worker_id"]))


def _describe_call(target: Any, loader: Optional[Dict[str, Any]], one: bool = False) -> str:
    if loader is not None:
        holder = loader.get("dataset_holder", loader.get("dataset"))
        dataset = holder[0] if isinstance(holder, list) and holder else holder
        iterators = "iterator" if one else "iterator(s)"
        return f"DataLoader {iterators} over {type(dataset).__name__}"
    name = getattr(target, "__qualname__", None) or repr(target)
    return f"process(es) running {getattr(target, '__module__', '?')}.{name}"


def worker_state(ready: bool, leased_to: Optional[str], reserved: bool) -> str:
    """A worker's state as ``tether.status()`` shows it."""
    if not ready:
        return "starting"
    if leased_to is not None:
        return f"leased to {leased_to}"
    return "reserved for a DataLoader" if reserved else "ready"


class LeaseHost(Protocol):
    """What the leases need of the pool that hosts them (its ``core.Core``)."""

    @property
    def broken(self) -> Optional[str]:
        """Why the pool is broken, or None."""

    @property
    def state(self) -> str:
        """The state of the pool: running, shutdown or closed."""

    @property
    def hub(self) -> Optional[threading.Thread]:
        """The thread that takes the worker set's events (None before it starts)."""

    def join_replacements(self) -> None:
        """Waits until the workers being started to replace dead ones are in the set."""

    def wait_workers(self, timeout: float) -> None:
        """Waits up to ``timeout`` until every worker of the pool is ready."""


class Leases:
    """The pool's leases: what each one runs (by lease id), the workers a DataLoader being
    started reserved, and the objects the workers keep of the loaders they served. It is
    what a pool context lends its processes' workers from (``loader.Lender``)."""

    def __init__(
        self,
        workers: _native.WorkerSet,
        ids: "itertools.count[int]",
        size: int,
        start_method: str,
        host: LeaseHost,
    ) -> None:
        self.workers = workers
        self.ids = ids
        self.size = size
        self.start_method = start_method
        self.host = host
        #: lease id -> what it runs (for errors and ``tether.status()``).
        self.running: Dict[int, str] = {}
        self.reserved: "weakref.WeakKeyDictionary[Any, List[int]]" = weakref.WeakKeyDictionary()
        #: The DataLoader iterators served, by their done event.
        self.runs: "weakref.WeakKeyDictionary[Any, Run]" = weakref.WeakKeyDictionary()
        #: What the workers keep of the DataLoaders they served.
        self.kept = datasets.Kept(workers.wake)
        #: When ``free_held_workers`` last collected garbage.
        self.collected = -1.0

    def lend(
        self,
        target: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Dict[str, Any],
        keep_datasets: bool = True,
    ) -> Leased:
        """Takes a worker for a process (for a DataLoader's first worker, as many as the
        loader has workers, or a clear error), pickles the process's call (passing the fds
        it names) and sends it there. For torch's DataLoader worker loop, the dataset,
        ``collate_fn`` and ``worker_init_fn`` travel as ``datasets.Kept`` decides: a
        reference to the worker's copy, or one pickle shared by the loader's workers."""
        if self.host.broken is not None:
            raise BrokenPool(self.host.broken)
        if self.host.state != "running":
            raise RuntimeError("the tether.Pool is shut down")
        loader = dataloader_call(target, args, kwargs)
        recycle.release_gone()
        lease_id = next(self.ids)
        slot = self._take_slot(loader)
        if slot is None:
            slot = self._free_a_slot(target, loader)
        run = None if loader is None else self._run_of(target, loader)
        try:
            forget = shipment.Forgetting(())
            commit: Optional[Callable[[], None]] = None
            if loader is not None:
                kwargs, forget, commit = self.kept.prepare(
                    loader, slot, self._pid_in(slot), keep_datasets
                )
                args = ()
            collector = pickling.FdCollector()
            # torch's worker loop seeds the random generators itself (see worker._run_lease).
            blob = pickling.dumps((forget, target, args, kwargs, loader is not None), collector)
            lease = self.workers.lease(slot, lease_id, blob, collector.fds)
        except BaseException:
            self.workers.unreserve([slot])
            raise
        if commit is not None:
            commit()
        if run is not None and loader is not None:
            run.add(lease, loader.get("index_queue"))
        self.running[lease_id] = _describe_call(target, loader)
        return Leased(lease, loader is not None, collector.channels, run)

    def leased_to(self, lease: Optional[int]) -> Optional[str]:
        """What lease ``lease`` runs (for ``tether.status()``), None when nothing runs."""
        return None if lease is None else self.running.get(lease)

    def send_forgotten(self) -> None:
        """Tells each worker that holds objects the parent dropped to drop its copies now
        (a note it reads once its lease, if any, is over), so that the next loader does not
        wait for it and its memory goes as soon as the parent's does."""
        for slot, keys in self.kept.forgotten().items():
            data = pickling.dumps(shipment.Forgetting(keys), pickling.FdCollector())
            if not self.workers.note(slot, data):
                self.kept.forget_later(slot, keys)

    def _free_a_slot(self, target: Any, loader: Optional[Dict[str, Any]]) -> int:
        """A slot when none was free: an iterator that is garbage but not yet collected (in
        a reference cycle with the traceback of an error it raised) gives its workers back
        when collected; a failed one's workers are taken back (see ``runs``); a worker
        that died may be being replaced. Then one more try, or ``NoFreeWorkerError``."""
        gc.collect()
        asking = (
            f"a {_describe_call(target, loader, one=True)} asked for workers"
            if loader is not None
            else "a process asked for a worker"
        )
        if self.take_back_failed(asking, wait=True):
            self.host.wait_workers(runs.GRACE + 5.0)
        self.host.join_replacements()
        slot = self._take_slot(loader)
        if slot is None:
            num_workers = None if loader is None else int(loader["num_workers"])
            raise NoFreeWorkerError(self._exhausted(_need(loader), num_workers))
        return slot

    def _run_of(self, target: Any, loader: Dict[str, Any]) -> Optional[Run]:
        """The run of the DataLoader iterator a worker loop belongs to (made with its first
        worker)."""
        done_event = loader.get("done_event")
        if done_event is None:
            return None
        run = self.runs.get(done_event)
        if run is None:
            runs.install_pid_tracking()
            run = Run(_describe_call(target, loader, one=True), done_event)
            run.on_failure = self._run_failed
            self.runs[done_event] = run
            data_queue = loader.get("data_queue")
            if isinstance(data_queue, channel.Queue) and hasattr(data_queue, "run"):
                data_queue.run = run
        return run

    # -- taking workers back (see ``runs``) ----------------------------------------------

    def _run_failed(self, run: Run) -> None:
        """An iterator's next() raised: its workers go back at once when a task waits."""
        if self.workers.queued() and not self._any_free():
            self.take_back_failed("a task was waiting for a worker", wait=False)

    def take_back_failed(self, asking: str, wait: bool) -> bool:
        """Takes back the workers of every failed run, because ``asking``; with ``wait``,
        returns once they are free (or killed). Whether there was any."""
        failed = [r for r in list(self.runs.values()) if r.failure and r.live()]
        running: List[_native.Lease] = []
        for run in failed:
            running.extend(run.take_back(f"its last next() raised {run.failure}, and {asking}"))
        self._end(running, wait)
        return bool(failed)

    def take_back_all(self, why: str) -> None:
        """Takes back the workers of every run (the pool shuts down)."""
        running: List[_native.Lease] = []
        for run in list(self.runs.values()):
            if run.live():
                running.extend(run.take_back(why))
        self._end(running, wait=False)

    def _end(self, running: List[_native.Lease], wait: bool) -> None:
        if wait:
            runs.kill_after(running, self._kill)
        else:
            runs.kill_later(running, self._kill)

    def _kill(self, lease: _native.Lease) -> None:
        runs.untrack([lease.pid])
        self.workers.signal_lease(lease, signal.SIGKILL)

    def _any_free(self) -> bool:
        return any(w.lease is None and not w.reserved for w in self.workers.workers())

    def _pid_in(self, slot: int) -> int:
        for worker in self.workers.workers():
            if worker.slot == slot:
                return worker.pid
        return 0

    def _take_slot(self, loader: Optional[Dict[str, Any]]) -> Optional[int]:
        """A reserved or free worker's slot for a process (see ``lease``), or None."""
        done_event = None if loader is None else loader.get("done_event")
        if loader is not None and done_event is not None and loader["worker_id"] > 0:
            reserved = self.reserved.get(done_event)
            if reserved:
                return reserved.pop(0)
        slots = self.workers.reserve(_need(loader))
        if not slots:
            return None
        rest = slots[1:]
        if rest and done_event is not None:
            self.reserved[done_event] = rest
            weakref.finalize(done_event, self.workers.unreserve, rest)
        elif rest:
            self.workers.unreserve(rest)
        return slots[0]

    def _exhausted(self, need: int, num_workers: Optional[int]) -> str:
        """Why no worker is free, and what to do about it."""
        what = (
            f"a DataLoader with num_workers={num_workers}"
            if num_workers is not None
            else "a process"
        )
        head = f"tether.Pool(processes={self.size}) cannot lease {need} worker(s) for {what}"
        if need > self.size:
            return (
                f"{head}: the pool has only {self.size} workers. Make the pool larger "
                f"(tether.Pool({need}) or more), or lower num_workers to {self.size} or less."
            )
        holders: Dict[str, List[int]] = {}
        reserved = free = 0
        for worker in self.workers.workers():
            if worker.lease is not None:
                holders.setdefault(self.running.get(worker.lease, "a process"), []).append(
                    worker.pid
                )
            elif worker.reserved:
                reserved += 1
            else:
                free += 1
        held = sum(len(p) for p in holders.values())
        lines = [
            f"{head}: only {free} of its {self.size} workers are free; {held} are leased"
            + (f" and {reserved} reserved by a DataLoader being started" if reserved else "")
            + (":" if holders else ".")
        ]
        for description, pids in holders.items():
            lines.append(f"  - {len(pids)} by {description} (pid {', '.join(map(str, pids))})")
        lines.append(
            "A DataLoader iterator keeps its workers until it is exhausted or deleted (with "
            "persistent_workers, until the loader is deleted); one whose last next() raised "
            "gives them back when another loader or a task needs them. Finish or delete the "
            "other iterations, lower num_workers, or make the pool larger."
        )
        return "\n".join(lines)

    def send_signal(self, lease: _native.Lease, signum: int) -> None:
        """Sends ``signum`` to the worker of ``lease`` while the lease runs (once it
        ended, the worker may serve someone else: nothing is sent)."""
        self.workers.signal_lease(lease, signum)

    def ended(self, slot: int, lease: _native.Lease) -> None:
        """A lease ended (its process returned, or its worker died)."""
        self.running.pop(lease.id, None)
        end = lease.end()
        if end is not None and end.code != 0:
            self.kept.lost(slot)

    def free_held_workers(self) -> None:
        """When a task waits and no worker is free: the workers of failed DataLoader
        iterators are taken back, and an iterator that is garbage but not collected yet (in
        a reference cycle) may hold some: the garbage is collected, at most once a second,
        never from the pool's hub (an iterator's finalizer waits for the hub)."""
        if threading.current_thread() is self.host.hub or self._any_free():
            return
        if self.workers.queued():
            self.take_back_failed("a task was waiting for a worker", wait=False)
        now = time.monotonic()
        if now - self.collected >= 1.0 and any(w.lease is not None for w in self.workers.workers()):
            self.collected = now
            gc.collect()
