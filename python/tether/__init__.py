"""tether: a Rust-core process runtime for PyTorch-style multi-process work on Linux.

``tether.spawn`` / ``tether.start_processes`` / ``tether.ProcessContext`` are a drop-in for
``torch.multiprocessing.spawn``: every child leads its own process group, dies with its
parent, is watched from a Rust supervisor thread through a pidfd, and reports its failure
(traceback and exception) whole. Importing tether never imports torch."""

from typing import Any

from ._native import __version__
from .errors import ProcessException, ProcessExitedException, ProcessRaisedException
from .spawn import ProcessContext, spawn, start_processes

#: Imported on first use, so that a child's start-up does not pay for them.
_LAZY = {
    "BrokenPool": ".pool",
    "NoFreeWorkerError": ".pool",
    "Pool": ".pool",
    "RemoteError": ".pool",
    "WorkerCrashedError": ".pool",
    "set_preload": "._zygote",
    "warm_up": "._zygote",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tether' has no attribute {name!r}")


__all__ = [
    "BrokenPool",
    "NoFreeWorkerError",
    "Pool",
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "RemoteError",
    "WorkerCrashedError",
    "__version__",
    "set_preload",
    "spawn",
    "start_processes",
    "warm_up",
]
