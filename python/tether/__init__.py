"""tether: a Rust-core process runtime for PyTorch-style multi-process work on Linux.

``tether.spawn`` / ``tether.start_processes`` / ``tether.ProcessContext`` are a drop-in for
``torch.multiprocessing.spawn``: every child leads its own process group, dies with its
parent, is watched from a Rust supervisor thread through a pidfd, and reports its failure
(traceback and exception) whole. Importing tether never imports torch."""

from ._native import __version__
from ._zygote import set_preload, warm_up
from .errors import ProcessException, ProcessExitedException, ProcessRaisedException
from .pool import Pool
from .spawn import ProcessContext, spawn, start_processes

__all__ = [
    "Pool",
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "__version__",
    "set_preload",
    "spawn",
    "start_processes",
    "warm_up",
]
