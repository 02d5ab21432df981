"""How ``tether.Pool`` lends its workers to processes (a DataLoader's, through
``pool.context()``): which worker a process gets (a DataLoader's first worker reserves as
many as the loader has, or fails with an error that names who holds them), what travels to
it (the call; for torch's DataLoader worker loop, the dataset, ``collate_fn`` and
``worker_init_fn`` as the pool's dataset cache, ``_datasets.Kept``, decides), and what the
pool says of the leases it made."""

from __future__ import annotations

import gc
import inspect
import itertools
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence

from . import _datasets, _native, _pickling, _shipment
from ._pool_errors import BrokenPool
from .context import Leased
from .errors import NoFreeWorkerError

_signatures: Dict[Any, Optional[inspect.Signature]] = {}


def dataloader_call(
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


def _describe_call(target: Any, loader: Optional[Dict[str, Any]]) -> str:
    if loader is not None:
        holder = loader.get("dataset_holder", loader.get("dataset"))
        dataset = holder[0] if isinstance(holder, list) and holder else holder
        return f"DataLoader iterator(s) over {type(dataset).__name__}"
    name = getattr(target, "__qualname__", None) or repr(target)
    return f"process(es) running {getattr(target, '__module__', '?')}.{name}"


def worker_state(ready: bool, leased_to: Optional[str], reserved: bool) -> str:
    """A worker's state as ``tether.status()`` shows it."""
    if not ready:
        return "starting"
    if leased_to is not None:
        return f"leased to {leased_to}"
    return "reserved for a DataLoader" if reserved else "ready"


class Lifecycle(Protocol):
    """What leasing needs of the pool's lifecycle."""

    @property
    def broken(self) -> Optional[str]:
        """Why the pool is broken, or None."""

    @property
    def state(self) -> str:
        """The state of the pool: running, shutdown or closed."""

    def join_replacements(self) -> None:
        """Waits until the workers being started to replace dead ones are in the set."""


class Leases:
    """The pool's leases: what each one runs (by lease id), the workers a DataLoader being
    started reserved, and the objects the workers keep of the loaders they served."""

    def __init__(
        self,
        workers: _native.WorkerSet,
        ids: "itertools.count[int]",
        size: int,
        lifecycle: Lifecycle,
    ) -> None:
        self.workers = workers
        self.ids = ids
        self.size = size
        self.lifecycle = lifecycle
        #: lease id -> what it runs (for errors and ``tether.status()``).
        self.running: Dict[int, str] = {}
        self.reserved: "weakref.WeakKeyDictionary[Any, List[int]]" = weakref.WeakKeyDictionary()
        #: What the workers keep of the DataLoaders they served.
        self.kept = _datasets.Kept()
        #: When ``free_held_workers`` last collected garbage.
        self.collected = -1.0

    def lease(
        self,
        target: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Dict[str, Any],
        keep_datasets: bool = True,
    ) -> Leased:
        """Takes a worker for a process (for a DataLoader's first worker, as many as the
        loader has workers, or a clear error), pickles the process's call (passing the fds
        it names) and sends it there. For torch's DataLoader worker loop, the dataset,
        ``collate_fn`` and ``worker_init_fn`` travel as ``_datasets.Kept`` decides: a
        reference to the worker's copy, or one pickle shared by the loader's workers."""
        if self.lifecycle.broken is not None:
            raise BrokenPool(self.lifecycle.broken)
        if self.lifecycle.state == "closed":
            raise RuntimeError("the tether.Pool is shut down")
        loader = dataloader_call(target, args, kwargs)
        lease_id = next(self.ids)
        try:
            slot = self._take_slot(loader)
        except NoFreeWorkerError:
            # An iterator that is garbage but not yet collected (in a reference cycle with
            # the traceback of an error it raised) still holds workers: collect it (its
            # __del__ gives them back); a worker that died may be being replaced: wait for
            # that. Then try once more.
            gc.collect()
            self.lifecycle.join_replacements()
            slot = self._take_slot(loader)
        try:
            forget = _shipment.Forgetting(())
            commit: Optional[Callable[[], None]] = None
            if loader is not None:
                kwargs, forget, commit = self.kept.prepare(
                    loader, slot, self._pid_in(slot), keep_datasets
                )
                args = ()
            collector = _pickling.FdCollector()
            # torch's worker loop seeds the random generators itself (see _worker._run_lease).
            blob = _pickling.dumps((forget, target, args, kwargs, loader is not None), collector)
            lease = self.workers.lease(slot, lease_id, blob, collector.fds)
        except BaseException:
            self.workers.unreserve([slot])
            raise
        if commit is not None:
            commit()
        self.running[lease_id] = _describe_call(target, loader)
        return Leased(lease, loader is not None, collector.channels)

    def _pid_in(self, slot: int) -> int:
        for worker in self.workers.workers():
            if worker.slot == slot:
                return worker.pid
        return 0

    def _take_slot(self, loader: Optional[Dict[str, Any]]) -> int:
        """A reserved or free worker's slot for a process (see ``lease``)."""
        done_event = None if loader is None else loader.get("done_event")
        if loader is not None and done_event is not None and loader["worker_id"] > 0:
            reserved = self.reserved.get(done_event)
            if reserved:
                return reserved.pop(0)
        need = (
            1 if loader is None else max(1, int(loader["num_workers"]) - int(loader["worker_id"]))
        )
        slots = self.workers.reserve(need)
        if not slots:
            num_workers = None if loader is None else int(loader["num_workers"])
            raise NoFreeWorkerError(self._exhausted(need, num_workers))
        rest = slots[1:]
        if rest and done_event is not None:
            self.reserved[done_event] = rest
            weakref.finalize(done_event, self.workers.unreserve, rest)
        elif rest:
            self.workers.unreserve(rest)
        return slots[0]

    def _exhausted(self, need: int, num_workers: Optional[int]) -> str:
        what = (
            f"a DataLoader with num_workers={num_workers}"
            if num_workers is not None
            else "a process"
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
            f"tether.Pool(processes={self.size}) cannot lease {need} worker(s) for {what}: "
            f"only {free} of its {self.size} workers are free; {held} are leased"
            + (f" and {reserved} reserved by a DataLoader being started" if reserved else "")
            + (":" if holders else ".")
        ]
        for description, pids in holders.items():
            lines.append(f"  - {len(pids)} by {description} (pid {', '.join(map(str, pids))})")
        lines.append(
            "A DataLoader iterator keeps its workers until it is exhausted or deleted (with "
            "persistent_workers, until the loader is deleted). Make the pool larger, lower "
            "num_workers, or finish the other iterations first."
        )
        return "\n".join(lines)

    def signal(self, lease: _native.Lease, signum: int) -> None:
        self.workers.signal_lease(lease, signum)

    def ended(self, slot: int, lease: _native.Lease) -> None:
        """A lease ended (its process returned, or its worker died)."""
        self.running.pop(lease.id, None)
        end = lease.end()
        if end is not None and end.code != 0:
            self.kept.lost(slot)

    def free_held_workers(self, hub: Optional[threading.Thread]) -> None:
        """When no worker is free, a DataLoader iterator that is garbage but not collected
        yet (in a reference cycle) may hold some: collects the garbage, at most once a
        second, never from the ``hub`` (an iterator's finalizer waits for the hub)."""
        now = time.monotonic()
        if now - self.collected < 1.0 or threading.current_thread() is hub:
            return
        workers = self.workers.workers()
        if any(w.lease is None and not w.reserved for w in workers):
            return
        if any(w.lease is not None for w in workers):
            self.collected = now
            gc.collect()
