"""tether: a Rust-core process runtime for PyTorch-style multi-process work on Linux.

``tether.spawn`` / ``tether.start_processes`` / ``tether.ProcessContext`` are a drop-in for
``torch.multiprocessing.spawn``: every child leads its own process group, dies with its
parent, is watched from a Rust supervisor thread through a pidfd, and reports its failure
(traceback and exception) whole. Importing tether never imports torch."""

from typing import Any

# Binds the compiled module as an attribute of the package even when it was loaded first
# on its own (see _tether_stacks).
from . import _native
from .errors import (
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    ProcessTimeoutError,
)
from .spawn import ProcessContext, SpawnContext, spawn, start_processes

__version__ = _native.__version__

#: Imported on first use, so that a child's start-up does not pay for them.
_LAZY = {
    "BrokenPool": ".pool",
    "NoFreeWorkerError": ".pool",
    "Pool": ".pool",
    "RemoteError": ".pool",
    "WorkerCrashedError": ".pool",
    "set_preload": "._zygote",
    "warm_up": "._zygote",
    "status": "._status",
    "ZygoteError": "._zygote",
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
    "ProcessTimeoutError",
    "RemoteError",
    "SpawnContext",
    "WorkerCrashedError",
    "__version__",
    "set_preload",
    "ZygoteError",
    "spawn",
    "start_processes",
    "status",
    "warm_up",
]
