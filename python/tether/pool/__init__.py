"""``tether.pool``: long-lived worker processes that many DataLoaders borrow in turn or at the
same time (``DataLoader(..., multiprocessing_context=pool.context())``), and
``concurrent.futures`` executors over the same workers.

The public names are ``Pool``, ``ProcessPoolExecutor`` and the pool's exceptions
(``BrokenPool``, ``WorkerCrashedError``, ``NoFreeWorkerError``, ``RemoteError``); each is
imported on first use, so that a worker, which imports only its own side of the package
(``worker`` and what it needs), pays for none of the parent's.

The package's modules, by concern (each states its contract):

- the faces: ``facade`` (``tether.Pool``), ``executor`` (``tether.ProcessPoolExecutor``);
- the parent's machinery: ``core`` (the workers' start and healing, the hub thread, the
  states running -> shutdown -> closed), ``tasks`` (``submit`` and ``map``, and what a
  worker's death does to them), ``futures`` (where a task's outcome goes), ``leases`` (the
  workers lent to processes), ``runs`` (a DataLoader iterator's leases, and taking them
  back), ``loader`` (``pool.context()``, the DataLoader's multiprocessing context, which
  asks the leases for its workers), ``errors``;
- what crosses to the workers: ``channel`` (queues and events), ``datasets`` (the parent's
  record of what the workers keep), ``shipment`` (how a loader's objects travel, and the
  worker's copy of them), ``snapshot`` (what proves a kept object unchanged), ``trust``
  (when a worker may trust its last proof of a copy);
- the worker: ``worker`` (its loop), ``shm`` (memfd shared memory for the tensors it
  sends), ``recycle`` and ``recycle_page`` (batch storages that come back to it)."""

from typing import TYPE_CHECKING, Any, Dict, List

if TYPE_CHECKING:
    from tether.errors import NoFreeWorkerError, RemoteError

    from .errors import BrokenPool, WorkerCrashedError
    from .executor import ProcessPoolExecutor
    from .facade import Pool

#: Each public name and the module that defines it, imported on first use.
_LAZY: Dict[str, str] = {
    "BrokenPool": ".errors",
    "NoFreeWorkerError": "..errors",
    "Pool": ".facade",
    "ProcessPoolExecutor": ".executor",
    "RemoteError": "..errors",
    "WorkerCrashedError": ".errors",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BrokenPool",
    "NoFreeWorkerError",
    "Pool",
    "ProcessPoolExecutor",
    "RemoteError",
    "WorkerCrashedError",
]
