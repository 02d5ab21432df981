"""Preloading a warm zygote's modules under watch: a module is left to the ranks when its
import read what differs between the ranks of a node or between attempts, or left the
zygote unable to fork safely. While each module is imported, the watch notes, in the code
of installed packages (the standard library and the import system are trusted, tether
fixes what they keep in each rank):

- a read of a variable that differs between ranks or attempts (``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, ``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``, ...: none of them is in
  the zygote's environment), or of the whole environment (a copy, an iteration);
- a read of ``sys.argv``, of the process id (``os.getpid()``), of the working directory
  (``os.getcwd()``, ``pathlib.Path.cwd()``) or of ``__main__``'s attributes (its
  ``__file__``, ...);

and after each module, a thread still running (once a throwaway fork has let libraries
stop theirs), CUDA initialized (``torch.cuda.is_initialized()``, or a device of
``/dev/nvidia*`` open), a module of the user's imported, or a change of what the rank's first
line would see otherwise (the environment, ``sys.path``, a signal handler, the standard
streams, ``sys.excepthook``, the builtins, the working directory). Reads through Python are seen;
a C extension's own ``getenv`` is not. What the modules print while they are imported is
kept (``captured``), so that each rank shows it as a new interpreter would."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import types
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Set, Tuple

from . import _warm_scan, _zygote_server


class Found(NamedTuple):
    """What the preload did: the modules imported, those to leave to the ranks (with why),
    those whose import failed (with the error), and the installed packages that the
    imports of modules left out brought in (worth preloading on their own: torch, under a
    package that reads ``RANK``)."""

    preloaded: List[str]
    left_out: List[Tuple[str, str]]
    failed: List[Tuple[str, str]]
    beneath: List[str]


#: The watch in force while a module is imported, else None.
_watch: Optional["Watch"] = None

#: Code that only hands a read on to its caller (``os.environ.get``, ``Path.cwd``,
#: ``argparse``'s default program name): the read is its caller's.
_RELAYS = {"os", "collections.abc", "_collections_abc", "pathlib", "argparse", "getopt"} | {
    "optparse",
    __name__,
}


def _reader(places: _warm_scan.Places) -> Optional[str]:
    """The module whose code made the read in progress, when it is not the standard
    library's, the import system's or tether's; else None."""
    frame: Optional[types.FrameType] = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module in _RELAYS:
            frame = frame.f_back
            continue
        path = frame.f_code.co_filename
        if path.startswith("<frozen") or not os.path.isabs(path):
            return None
        return None if places.kind(path) in ("stdlib", "tether") else str(module or path)
    return None


class Watch:
    """Notes the reads of the module being imported (see the module's documentation)."""

    def __init__(self, varying: Set[str], places: _warm_scan.Places) -> None:
        self.varying = varying
        self.places = places
        self.reads: List[str] = []
        self.undo: List[Callable[[], None]] = []

    def saw(self, what: str) -> None:
        reader = _reader(self.places)
        if reader is not None:
            self.reads.append(f"its import read {what}, in {reader}")

    def __enter__(self) -> "Watch":
        global _watch
        _watch = self
        for environ in (os.environ, os.environb):
            self._swap_class(environ, _WatchedEnviron)
        main = sys.modules.get("__main__")
        if type(main) is types.ModuleType:
            self._swap_class(main, _WatchedMain)
        argv = sys.argv
        sys.argv = _WatchedArgv(argv)
        self.undo.append(lambda: setattr(sys, "argv", argv))
        for name, what in (("getpid", "the process id"), ("getcwd", "the working directory")):
            self._wrap(name, what)
        self._wrap("getcwdb", "the working directory")
        return self

    def _swap_class(self, obj: Any, watched: type) -> None:
        plain = type(obj)
        obj.__class__ = watched
        self.undo.append(lambda: setattr(obj, "__class__", plain))

    def _wrap(self, name: str, what: str) -> None:
        real = getattr(os, name)

        def watched() -> Any:
            if _watch is not None:
                _watch.saw(what)
            return real()

        setattr(os, name, watched)
        self.undo.append(lambda: setattr(os, name, real))

    def __exit__(self, *exc: object) -> None:
        global _watch
        _watch = None
        while self.undo:
            self.undo.pop()()


class _WatchedEnviron(os._Environ):
    def __getitem__(self, key: Any) -> Any:
        name = key.decode(errors="replace") if isinstance(key, bytes) else key
        if _watch is not None and name in _watch.varying:
            _watch.saw(f"${name}")
        return super().__getitem__(key)

    def __iter__(self) -> Iterator[Any]:
        if _watch is not None:
            _watch.saw("the whole environment")
        return super().__iter__()


class _WatchedMain(types.ModuleType):
    def __getattribute__(self, name: str) -> Any:
        # (``import __main__`` itself reads its ``__spec__``, from the import system's C code.)
        if _watch is not None and name not in ("__class__", "__dict__", "__spec__"):
            _watch.saw(f"__main__.{name}")
        return super().__getattribute__(name)


class _WatchedArgv(List[str]):
    def _saw(self) -> None:
        if _watch is not None:
            _watch.saw("sys.argv")

    def __getitem__(self, index: Any) -> Any:
        self._saw()
        return super().__getitem__(index)

    def __iter__(self) -> Iterator[str]:
        self._saw()
        return super().__iter__()

    def __len__(self) -> int:
        self._saw()
        return super().__len__()

    def __contains__(self, item: object) -> bool:
        self._saw()
        return super().__contains__(item)


def threads() -> List[str]:
    """The names of this process's threads but the main one (Python's names for Python
    threads)."""
    import threading

    named = {t.native_id: t.name for t in threading.enumerate()}
    names = []
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == os.getpid():
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


def _state() -> Dict[str, Any]:
    """What a module's import may change of what a rank sees before its first line, by the
    words that name it."""
    import builtins
    import threading

    handlers = {}
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            handlers[sig] = signal.getsignal(sig)
    return {
        "the environment": dict(os.environ),
        "sys.path": list(sys.path),
        "a signal handler": handlers,
        "the standard streams": [id(sys.stdin), id(sys.stdout), id(sys.stderr)],
        "sys.excepthook": [id(sys.excepthook), id(threading.excepthook)],
        "the builtins": {k: id(v) for k, v in vars(builtins).items()},
        "the working directory": os.getcwd(),
    }


def _import_one(name: str, watch: Watch, found: Found) -> None:
    """Imports ``name``; notes in ``found`` whether it stays or is left to the ranks."""
    known = set(sys.modules)
    before = len(threads())
    cuda_before = cuda_in_use()
    state = _state()
    watch.reads.clear()
    try:
        importlib.import_module(name)
    except BaseException as exc:  # noqa: BLE001 - an import may even call sys.exit
        found.failed.append((name, f"{type(exc).__name__}: {exc}"))
        return
    why = list(watch.reads[:1])
    after = _state()
    why += [f"its import changed {what}" for what in state if after[what] != state[what]][:1]
    if len(threads()) > before:
        _zygote_server._quiesce()
        running = threads()
        if len(running) > before:
            why.append(f"its import left a thread running ({running[-1]!r})")
    if not cuda_before and cuda_in_use():
        why.append("its import initialized CUDA")
    new = set(sys.modules) - known
    own = [m for m in new if _is_users(sys.modules.get(m), watch.places)]
    if own:
        why.append(f"its import imported {sorted(own)[0]}, a module of yours")
    if not why:
        found.preloaded.append(name)
        return
    found.left_out.append((name, "; ".join(why)))
    top = name.split(".")[0]
    for module in sorted(m for m in new if "." not in m and m != top):
        if _is_installed(sys.modules.get(module), watch.places):
            found.beneath.append(module)


def _kind(module: Optional[types.ModuleType], places: _warm_scan.Places) -> str:
    path = getattr(module, "__file__", None)
    if isinstance(path, str) and os.path.isabs(path):
        return places.kind(path)
    return "unknown"


def _is_users(module: Optional[types.ModuleType], places: _warm_scan.Places) -> bool:
    return _kind(module, places) == "own"


def _is_installed(module: Optional[types.ModuleType], places: _warm_scan.Places) -> bool:
    return _kind(module, places) == "installed"


def preload(modules: List[str], varying: Set[str]) -> Found:
    """Imports each of ``modules`` under watch (``varying``: the variables that differ
    between ranks or attempts); what it found."""
    found = Found([], [], [], [])
    places = _warm_scan.Places()
    with Watch(varying, places) as watch:
        for name in modules:
            _import_one(name, watch, found)
    return found


class Captured:
    """What was written on stdout and stderr meanwhile."""

    def __init__(self) -> None:
        self.out: Dict[int, bytes] = {1: b"", 2: b""}


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None).fflush(None)  # what C code buffered in stdio


@contextlib.contextmanager
def captured() -> Iterator[Captured]:
    """Keeps what is written on fds 1 and 2 meanwhile (in memory files), instead of letting
    it reach the user's streams."""
    got = Captured()
    _flush()
    files = {fd: _high(os.memfd_create(f"tether-preload-{fd}")) for fd in (1, 2)}
    saved: Dict[int, Optional[int]] = {}
    for fd, file in files.items():
        try:
            saved[fd] = _high(os.dup(fd))
        except OSError:
            saved[fd] = None  # closed: it stays closed afterwards
        os.dup2(file, fd)
    try:
        yield got
    finally:
        _flush()
        for fd, file in files.items():
            os.lseek(file, 0, os.SEEK_SET)
            got.out[fd] = _zygote_server._child._read_all(file)
            copy = saved[fd]
            if copy is None:
                os.close(fd)
            else:
                os.dup2(copy, fd)
                os.close(copy)
            os.close(file)


def _high(fd: int) -> int:
    """``fd`` moved to a number above the standard streams' (close-on-exec)."""
    import fcntl

    if fd > 2:
        return fd
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(fd)
    return high


def replay(got: Captured) -> None:
    """Writes what was captured to this process's stdout and stderr (in a rank: its own)."""
    for fd, data in got.out.items():
        view = memoryview(data)
        with contextlib.suppress(OSError):
            while view:
                view = view[os.write(fd, view) :]
