"""tether: a Rust-core process runtime for PyTorch-style multi-process work on Linux.

``tether.spawn`` / ``tether.start_processes`` / ``tether.ProcessContext`` are a drop-in for
``torch.multiprocessing.spawn``: every child leads its own process group, dies with its
parent, is watched from a Rust thread (the warden) through a pidfd, and reports its failure
(traceback and exception) whole. Importing tether never imports torch.

``import tether as mp`` runs a program written for ``import torch.multiprocessing as mp``:
the rest of torch.multiprocessing's public names (``Process``, ``Queue``,
``set_start_method``, ``set_sharing_strategy``, ...) are torch's own, imported on first
use. ``tether.Pool`` is tether's own pool (a ``concurrent.futures.Executor``), and
``tether.ProcessPoolExecutor`` is ``concurrent.futures.ProcessPoolExecutor`` over it."""

from typing import TYPE_CHECKING, Any

# Binds the compiled module as an attribute of the package even when it was loaded first
# on its own (see _tether_stacks).
from . import _native

# The names ``tether.share`` and ``tether.spawn`` are the functions', not their folders'
# (below).
from . import share as _share_folder  # noqa: F401
from .errors import (
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    ProcessTimeoutError,
)
from .spawn import ProcessContext, SpawnContext, spawn, start_processes

# ``spawn`` is bound by the import above, after its folder was. ``share``'s folder (its
# docstring alone) is loaded first and its name dropped here, so that the function takes
# the name on first use (``__getattr__``) and a later import of ``tether.share.items``
# leaves it alone.
del globals()["share"]

if TYPE_CHECKING:  # what a type checker sees of the lazy names: the function, not the folder
    from .share.meeting import share as share

__version__ = _native.__version__

#: Imported on first use, so that a child's start-up does not pay for them.
_LAZY = {
    "BrokenPool": ".pool",
    "NoFreeWorkerError": ".pool",
    "Pool": ".pool",
    "ProcessPoolExecutor": ".pool",
    "RemoteError": ".pool",
    "WorkerCrashedError": ".pool",
    "SharedDict": ".share.items",
    "SharedList": ".share.items",
    "set_preload": ".zygote.client",
    "share": ".share.meeting",
    "warm_up": ".zygote.client",
    "status": ".spawn.census",
    "ZygoteError": ".zygote.client",
}

#: torch.multiprocessing's names that the standard library has no counterpart of.
_TORCH_ONLY = frozenset(
    {
        "ENV_VAR_PARALLEL_START",
        "get_all_sharing_strategies",
        "get_sharing_strategy",
        "init_reductions",
        "reductions",
        "set_sharing_strategy",
    }
)


#: The rest of torch.multiprocessing's public names, so that ``import tether as mp`` runs a
#: program written for ``import torch.multiprocessing as mp``: each is torch's own, imported
#: on first use (importing tether never imports torch). Without torch, the names that
#: torch.multiprocessing takes from the standard library come from there.
_TORCH_MP = frozenset(
    {
        "Array",
        "AuthenticationError",
        "Barrier",
        "BoundedSemaphore",
        "BufferTooShort",
        "Condition",
        "Event",
        "JoinableQueue",
        "Lock",
        "Manager",
        "Pipe",
        "Process",
        "ProcessError",
        "Queue",
        "RLock",
        "RawArray",
        "RawValue",
        "Semaphore",
        "SimpleQueue",
        "TimeoutError",
        "Value",
        "active_children",
        "allow_connection_pickling",
        "cpu_count",
        "current_process",
        "freeze_support",
        "get_all_start_methods",
        "get_context",
        "get_logger",
        "get_start_method",
        "log_to_stderr",
        "multiprocessing",
        "parent_process",
        "reducer",
        "set_executable",
        "set_forkserver_preload",
        "set_start_method",
    }
    | _TORCH_ONLY
)


def _torch_multiprocessing(name: str) -> Any:
    import importlib

    try:
        source = importlib.import_module("torch.multiprocessing")
    except ImportError:
        if name in _TORCH_ONLY:
            raise AttributeError(
                f"tether.{name} is torch.multiprocessing's, and torch is not installed"
            ) from None
        source = importlib.import_module("multiprocessing")
        if name == "multiprocessing":
            return source
    return getattr(source, name)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    elif name in _TORCH_MP:
        value = _torch_multiprocessing(name)
    else:
        raise AttributeError(f"module 'tether' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _TORCH_MP)


__all__ = [
    "BrokenPool",
    "NoFreeWorkerError",
    "Pool",
    "ProcessContext",
    "ProcessPoolExecutor",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "ProcessTimeoutError",
    "RemoteError",
    "SharedDict",
    "SharedList",
    "SpawnContext",
    "WorkerCrashedError",
    "__version__",
    "set_preload",
    "share",
    "ZygoteError",
    "spawn",
    "start_processes",
    "status",
    "warm_up",
]
