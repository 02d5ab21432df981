"""Functions and datasets for the pool tests. It imports no torch, so that a spawn worker
that unpickles them stays cheap (only a DataLoader's worker loop imports torch)."""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
import weakref
from typing import Any, List, Optional, Tuple


def square(x: int) -> int:
    return x * x


def add(a: int, b: int = 0) -> int:
    return a + b


def pid_of(_: Any = None) -> int:
    return os.getpid()


def parent_pid(_: Any = None) -> int:
    return os.getppid()


def sleep_then(seconds: float, value: Any = None) -> Any:
    time.sleep(seconds)
    return value


def hold(channel: Any, seconds: float) -> None:
    """Keeps ``channel`` (a queue received with the process) for ``seconds``."""
    time.sleep(seconds)


def raise_value_error(message: str) -> None:
    raise ValueError(message)


def segfault() -> None:
    """Dies of SIGSEGV (a real invalid read, as C code would)."""
    ctypes.string_at(0)


def c_exit(code: int) -> None:
    """Exits at the C level, skipping Python's clean-up."""
    os._exit(code)


def kill_self(signum: int = signal.SIGKILL) -> None:
    os.kill(os.getpid(), signum)


def crash(how: str) -> None:
    if how == "segfault":
        segfault()
    elif how == "sigkill":
        kill_self(signal.SIGKILL)
    elif how == "exit":
        c_exit(7)
    elif how == "sys_exit":
        sys.exit(9)
    raise ValueError(f"unknown crash {how!r}")


def maybe_crash(i: int, every: int) -> int:
    """Task of the race tests: every ``every``-th one kills its worker."""
    if i % every == every - 1:
        os._exit(3)
    return i


def parent_of_worker(_: Any = None) -> Optional[Tuple[str, int, bool]]:
    """What ``multiprocessing.parent_process()`` says in this worker."""
    parent = multiprocessing.parent_process()
    return None if parent is None else (parent.name, parent.pid, parent.is_alive())


def worker_state(_: Any = None) -> Tuple[int, bool, int]:
    """(pid, whether torch's DataLoader worker info is clear, datasets still alive here)."""
    gc.collect()
    worker = sys.modules.get("torch.utils.data._utils.worker")
    info_clear = worker is None or worker._worker_info is None
    return os.getpid(), info_clear, len(LIVE_DATASETS)


# -- objects that misbehave while pickled or unpickled (loky's crash matrix) -------------------


def _exit_at_unpickle() -> None:
    sys.exit(5)


def _error_at_unpickle() -> None:
    raise ValueError("error while unpickling")


def _c_exit_at_unpickle() -> None:
    os._exit(0)


def _segfault_at_unpickle() -> None:
    segfault()


class ExitAtPickle:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        sys.exit(5)


class ErrorAtPickle:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        raise ValueError("error while pickling")


class CExitAtPickle:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        os._exit(0)


class SegfaultAtPickle:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        segfault()


class ExitAtUnpickle:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return _exit_at_unpickle, ()


class ErrorAtUnpickle:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return _error_at_unpickle, ()


class CExitAtUnpickle:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return _c_exit_at_unpickle, ()


class SegfaultAtUnpickle:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return _segfault_at_unpickle, ()


class CExitAtGC:
    """Kills the worker that garbage collects it (a crash while the task is cleaned up);
    harmless in the process that made it."""

    def __init__(self) -> None:
        self.home = os.getpid()

    def __del__(self) -> None:
        if os.getpid() != self.home:
            os._exit(4)


def identity(x: Any) -> Any:
    return x


def make(kind: str) -> Any:
    """Returns an object that misbehaves when it is pickled back to the parent."""
    return {
        "ExitAtPickle": ExitAtPickle,
        "ErrorAtPickle": ErrorAtPickle,
        "CExitAtPickle": CExitAtPickle,
        "SegfaultAtPickle": SegfaultAtPickle,
        "ExitAtUnpickle": ExitAtUnpickle,
        "ErrorAtUnpickle": ErrorAtUnpickle,
    }[kind]()


# -- datasets (map-style ones need no torch) -----------------------------------------------

LIVE_DATASETS: "weakref.WeakSet[Any]" = weakref.WeakSet()


class Squares:
    """A map-style dataset of ``i * i``; records its live copies in ``LIVE_DATASETS``."""

    def __init__(
        self,
        n: int = 64,
        fail_at: Optional[int] = None,
        crash_at: Optional[int] = None,
        crash_how: str = "sigkill",
        sleep: float = 0.0,
    ) -> None:
        self.n = n
        self.fail_at = fail_at
        self.crash_at = crash_at
        self.crash_how = crash_how
        self.sleep = sleep
        LIVE_DATASETS.add(self)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        LIVE_DATASETS.add(self)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if self.sleep:
            time.sleep(self.sleep)
        if i == self.fail_at:
            raise ValueError(f"bad item {i}")
        if i == self.crash_at:
            crash(self.crash_how)
        return i * i


class Probe:
    """Each item: (worker id, num_workers, seed, random draw, what worker_init_fn set)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> List[Any]:
        import torch.utils.data

        info = torch.utils.data.get_worker_info()
        return [
            info.id,
            info.num_workers,
            info.seed,
            random.random(),
            INIT_MARK.get("id", -1),
            os.getppid(),
        ]


INIT_MARK: dict = {}


def mark_init(worker_id: int) -> None:
    INIT_MARK["id"] = worker_id


def pair_collate(batch: List[int]) -> Tuple[str, List[int]]:
    return "custom", list(batch)


# -- the executor contract ---------------------------------------------------------------------


def capture(*args: Any, **kwargs: Any) -> Tuple[Tuple[Any, ...], dict]:
    return args, kwargs


def raise_runtime_error() -> None:
    raise RuntimeError(123)  # the line the remote traceback shows


class NeedsTwoArgumentsError(Exception):
    """Pickles, but cannot be rebuilt (its __init__ wants two arguments, its args hold one)."""

    def __init__(self, a: Any, b: Any) -> None:
        super().__init__(a)
        self.b = b


class HoldsALockError(Exception):
    """Cannot even be pickled."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        import threading

        self.lock = threading.Lock()


def raise_needs_two() -> None:
    raise NeedsTwoArgumentsError("first", "second")


def raise_holds_a_lock() -> None:
    raise HoldsALockError("locked out")


def unpicklable_result() -> Any:
    import threading

    return threading.Lock()


def write_after(path: str, seconds: float, text: str = "done") -> str:
    """Writes ``text`` to ``path`` after ``seconds``."""
    time.sleep(seconds)
    with open(path, "w") as f:
        f.write(text)
    return text


class Opaque:
    """A result whose only references are the ones the caller keeps."""


def make_opaque(_: Any = None) -> Opaque:
    return Opaque()


def wait_for_fifo(gate_dir: str) -> None:
    """Initializer: once ``gate_dir/hold`` exists, a worker blocks until a line is written to
    the FIFO ``gate_dir/fifo``."""
    if os.path.exists(os.path.join(gate_dir, "hold")):
        with open(os.path.join(gate_dir, "fifo")) as fifo:
            fifo.read()


# -- datasets that cross to the workers once ---------------------------------------------------

#: How many times a ``Counted`` was pickled in this process, and unpickled in this process.
COUNTS = {"pickled": 0, "unpickled": 0}


class Counted:
    """A map-style dataset that counts its picklings for another process (the pool's
    ``__getstate__`` calls that only compare it with what was sent do not count) and its
    unpicklings (per process, in ``COUNTS``). Item i: ``(pid, unpicklings in that process,
    tag, words, i)``."""

    def __init__(self, n: int = 4, tag: Any = 0, words: Optional[List[str]] = None) -> None:
        self.n = n
        self.tag = tag
        self.words = list(words or ())

    def __getstate__(self) -> dict:
        from multiprocessing.context import get_spawning_popen

        if get_spawning_popen() is not None:  # pickled to travel
            COUNTS["pickled"] += 1
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        COUNTS["unpickled"] += 1
        self.__dict__.update(state)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Tuple[int, int, Any, Tuple[str, ...], int]:
        return os.getpid(), COUNTS["unpickled"], self.tag, tuple(self.words), i


class Samples:
    """An ImageFolder-like dataset: ``n`` ``(path, class)`` samples; item i is its class."""

    def __init__(self, n: int) -> None:
        self.samples = [
            (f"/data/train/n{i // 1300:08d}/img_{i:08d}.JPEG", i // 1300) for i in range(n)
        ]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> int:
        return self.samples[i][1]


def rss_kib(_: Any = None) -> Tuple[int, int]:
    """(pid, resident set size in KiB) of this process, after a collection."""
    gc.collect()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return os.getpid(), int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


class InitsItself(Counted):
    """A ``Counted`` whose own method is the ``worker_init_fn`` (and another its
    ``collate_fn``): item i is ``(worker id its init saw, worker id torch says, pid,
    unpicklings)``."""

    def init(self, worker_id: int) -> None:
        self.inited = worker_id

    def collate(self, batch: List[Any]) -> List[Any]:
        return batch

    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        import torch.utils.data

        info = torch.utils.data.get_worker_info()
        return getattr(self, "inited", None), info.id, os.getpid(), COUNTS["unpickled"]


def in_its_module() -> bool:
    """Whether the function that runs is the one this module defines (it travelled by
    reference)."""
    return sys.modules[__name__].in_its_module is in_its_module


def spawn_in_its_module(rank: int) -> None:
    """A spawn target that fails unless it travelled by reference."""
    if sys.modules[__name__].spawn_in_its_module is not spawn_in_its_module:
        raise AssertionError("spawn_in_its_module travelled by value")


def first_one_ends(path: str, how: str) -> None:
    """An initializer: the first worker to run it ends (``how``: "exit 3" or "SIGKILL"), the
    others go on."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    if how == "SIGKILL":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)


def note_start(path: str, index: int, seconds: float) -> int:
    """Appends ``index`` to the file ``path`` (one write: lines never mix), then sleeps."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{index}\n".encode())
    finally:
        os.close(fd)
    time.sleep(seconds)
    return index


def run_main_script(script: Any, *args: str) -> Any:
    """Runs the test script ``script`` (a path) as ``__main__`` with ``args``; what it
    printed, as JSON (its stderr in the failure when it failed)."""
    import json

    run = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=os.path.dirname(str(script)),
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)
