"""What a preloaded import must leave as it found it, because tether cannot undo it for the
ranks that do not import it (``run.warm.record`` looks before and after): the settings of the
interpreter and of the libraries it knows (torch's default dtype, numpy's error handling,
...), the root logger's configuration, and what belongs to the process only (open files,
running threads and processes, CUDA). Each probe is read only when its library is
imported already; a probe that fails reads as ``None``."""

from __future__ import annotations

import gc
import os
import sys
import threading
from typing import Any, Callable, Dict, List, Set

Probe = Callable[[], Any]


def _sys_settings() -> Any:
    return (
        sys.getrecursionlimit(),
        sys.getswitchinterval(),
        sys.get_int_max_str_digits(),
        sys.getdlopenflags(),
        gc.get_threshold(),
        gc.isenabled(),
        _umask(),
    )


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _socket() -> Any:
    return sys.modules["_socket"].getdefaulttimeout()


def _torch() -> Any:
    torch = sys.modules["torch"]
    backends = sys.modules.get("torch.backends.cudnn")
    options = sys.modules.get("torch._tensor_str")
    return (
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.get_float32_matmul_precision(),
        torch.is_anomaly_enabled(),
        torch.initial_seed(),
        bytes(torch.get_rng_state().numpy()),
        None if backends is None else (backends.benchmark, backends.deterministic),
        None if options is None else dict(vars(options.PRINT_OPTS)),
    )


def _numpy() -> Any:
    numpy = sys.modules["numpy"]
    return (numpy.geterr(), numpy.get_printoptions(), numpy.getbufsize())


def _numpy_random() -> Any:
    state = sys.modules["numpy.random"].get_state(legacy=True)
    return (state[1].tobytes(), state[2])


def _root_logger() -> Any:
    logging = sys.modules["logging"]
    root = logging.root
    return (root.level, list(map(id, root.handlers)), root.disabled, logging.Logger.manager.disable)


#: Each probe, by the words that name what it reads, and the module it needs.
PROBES: Dict[str, tuple] = {
    "the interpreter's settings (recursion limit, gc, umask, ...)": ("sys", _sys_settings),
    "socket's default timeout": ("_socket", _socket),
    "torch's global settings or random state": ("torch._tensor_str", _torch),
    "numpy's global settings": ("numpy", _numpy),
    "numpy's global random state": ("numpy.random", _numpy_random),
    "the root logger's configuration": ("logging", _root_logger),
}


def read(ready: Set[str]) -> Dict[str, Any]:
    """The value of every probe whose module is in ``ready`` (fully imported)."""
    values = {}
    for what, (needs, probe) in PROBES.items():
        if needs in ready and needs in sys.modules:
            try:
                values[what] = probe()
            except Exception:  # noqa: BLE001 - a library that cannot say reads as None
                values[what] = None
    return values


def changed(before: Dict[str, Any], after: Dict[str, Any]) -> List[str]:
    """What differs between two readings of the same probes."""
    found = []
    for what, value in after.items():
        if what in before:
            try:
                same = bool(before[what] == value)
            except Exception:  # noqa: BLE001 - an odd value: taken as changed
                same = False
            if not same:
                found.append(what)
    return found


def fds() -> Set[int]:
    """This process's open fds."""
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def describe_fd(fd: int) -> str:
    try:
        return f"fd {fd} ({os.readlink(f'/proc/self/fd/{fd}')})"
    except OSError:
        return f"fd {fd}"


def children() -> List[int]:
    """The pids of this process's children that still run (or wait to be reaped)."""
    pids: List[int] = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += [int(pid) for pid in f.read().split()]
        except OSError:
            continue
    return pids


def signal_masks() -> Dict[str, str]:
    """The signals this process catches and ignores, as the kernel has them (a handler that
    C code installed shows here only)."""
    masks = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("SigCgt:", "SigIgn:")):
                key, _, value = line.partition(":")
                masks[key] = value.strip()
    return masks


_getpid = os.getpid  # (the real one: the witness's reads are the imports')


def threads() -> List[str]:
    """The names of this process's threads but the main one (Python's names for Python
    threads)."""
    named = {}
    for module in (threading, sys.modules.get("threading")):  # (tether's and the program's)
        if module is not None:
            named.update({t.native_id: t.name for t in module.enumerate()})
    names = []
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == _getpid():
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(named.get(int(tid)) or f.read().strip())
        except OSError:
            pass
    return names


def cuda_in_use() -> bool:
    """Whether this process has initialized CUDA: torch says so, or a device of
    ``/dev/nvidia*`` is open."""
    cuda = sys.modules.get("torch.cuda")
    try:
        if cuda is not None and cuda.is_initialized():
            return True
    except Exception:  # noqa: BLE001 - a torch that cannot say has not initialized it
        pass
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/nvidia"):
                return True
        except OSError:
            pass
    return False
