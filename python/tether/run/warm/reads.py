"""Where a warm zygote's recorder sees what a preloaded import reads (``run.warm.witness``): the
environment, ``sys.argv`` and ``__main__`` (their classes are swapped meanwhile), the
functions of ``time``, ``os`` and ``random`` that read the clock, random sources, the
process id or the working directory, and who read: the package whose code made the read
(through the standard library's helpers) or the standard library's own import."""

from __future__ import annotations

import os
import sys
import types
from typing import Any, Dict, Iterator, List, Optional, Protocol, Tuple

from . import scan


class Listener(Protocol):
    """What hears of the reads (the recorder's witness)."""

    def env_read(self, name: str, value: Optional[str]) -> None: ...

    def whole_env(self) -> None: ...

    def argv_read(self) -> None: ...

    def main_read(self, name: str) -> None: ...


#: The witness in force (while a zygote preloads), else None.
listener: Optional[Listener] = None

#: Code that only hands a read on to its caller: the read is its caller's.
_RELAYS = {"os", "posixpath", "genericpath", "collections.abc", "_collections_abc"}
_RELAYS |= {"pathlib", "argparse", "getopt", "optparse", __name__, "tether.run.warm.witness"}

#: The import system's modules: a read made under them (and no package's code) is the
#: standard library's module being imported.
_IMPORT_SYSTEM = {"importlib._bootstrap", "importlib._bootstrap_external"}
_IMPORT_SYSTEM |= {"_frozen_importlib", "_frozen_importlib_external"}

#: Where the standard library's own imports read what is each process's own, and how a rank
#: gets its own (``run.warm.serve.FIXUPS``): by the reading module, what it read.
STDLIB_READS = {
    ("random", "random numbers"): "random",
    ("logging", "the time"): "logging",
    ("multiprocessing.process", "random numbers"): "multiprocessing.process",
}

#: Where files are the kernel's views, not files an import's outcome depends on.
PSEUDO = ("/proc/", "/sys/", "/dev/")


#: The functions whose calls read what is each process's own, by module: name -> what.
_CLOCK = "time time_ns monotonic monotonic_ns perf_counter perf_counter_ns process_time"
_CLOCK += " process_time_ns thread_time thread_time_ns clock_gettime clock_gettime_ns"
READS: Dict[str, Dict[str, str]] = {
    "time": dict.fromkeys(_CLOCK.split(), "the time"),
    "os": {
        **dict.fromkeys(("urandom", "getrandom"), "random numbers"),
        **dict.fromkeys(("getpid", "getppid", "getpgrp", "getpgid", "getsid"), "the process id"),
        **dict.fromkeys(("getcwd", "getcwdb"), "cwd"),
    },
}
#: ``time``'s functions that read the clock only when given no time.
CLOCK_BY_DEFAULT = {"localtime": 0, "gmtime": 0, "ctime": 0, "asctime": 0, "strftime": 1}
#: ``random``'s functions that draw from its shared generator.
DRAWS = "random uniform triangular randint choice randrange sample shuffle choices gauss"
DRAWS += " normalvariate lognormvariate expovariate vonmisesvariate gammavariate betavariate"
DRAWS += " paretovariate weibullvariate getrandbits randbytes binomialvariate"


def reads_only(mode: Any, flags: Any) -> bool:
    """Whether an ``open`` event's mode (or, for ``os.open``, flags) only reads."""
    if isinstance(mode, str):
        return not any(c in mode for c in "wax+")
    if isinstance(flags, int):
        return flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) == 0
    return False


def reader(frame: Any, places: scan.Places, through: bool = True) -> Tuple[Optional[str], bool]:
    """The module whose code made the read in progress at ``frame`` (relays skipped), and
    whether it is the standard library's; (None, ...) for tether's own code. ``through``:
    a standard-library function called by a package reads for that package (a clock, a
    random source); else the standard library's own reads (a module scanning every module's
    ``__file__``, a copy of the environment) are its own business."""
    innermost: Optional[str] = None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        path = frame.f_code.co_filename
        if module in _IMPORT_SYSTEM:
            return innermost, True
        kind = "stdlib" if path.startswith("<frozen") else places.kind(path)
        if kind == "tether":
            return None, True
        if kind != "stdlib":
            return str(module or path), False
        if module not in _RELAYS and innermost is None:
            innermost = str(module)
            if not through:
                return innermost, True
        frame = frame.f_back
    return innermost, True


def internal(path: str) -> bool:
    """Whether a frame of ``path`` is the import system's, which the warnings module skips
    when it counts a warning's ``stacklevel`` (and tether's import hooks, named so)."""
    return "importlib" in path and "_bootstrap" in path


def hidden_from_warnings(function: Any) -> Any:
    """``function``, its frames named as the import system's (see ``internal``): a warning
    issued under it with a ``stacklevel`` points to the code that imported, as without it."""
    function.__code__ = function.__code__.replace(co_filename=IMPORT_SYSTEM_FILE)
    return function


IMPORT_SYSTEM_FILE = "<frozen importlib._bootstrap>"


#: Audit events of changes to files and directories (refused during a preload).
WRITES = {"os.mkdir", "os.remove", "os.rmdir", "os.rename", "os.symlink", "os.link"}
WRITES |= {"os.truncate", "os.chmod", "os.chown", "os.utime", "os.mkfifo", "os.mknod"}
WRITES |= {"shutil.copyfile", "shutil.copymode", "shutil.copystat", "shutil.move"}
WRITES |= {"shutil.rmtree", "shutil.chown", "os.kill", "os.killpg"}
#: Audit events of network use (refused during a preload).
CONNECTS = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"}


def harmless_write(path: str) -> bool:
    """Whether writing ``path`` during a preload is what every interpreter does alike: the
    import system's bytecode cache, the kernel's files."""
    return path.endswith(".pyc") and "__pycache__" in path or path.startswith(PSEUDO)


def frame_at(filename: str, lineno: int) -> Any:
    frame: Optional[types.FrameType] = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == filename and frame.f_lineno == lineno:
            return frame
        frame = frame.f_back
    return None


class WatchedEnviron(os._Environ):
    def __getitem__(self, key: Any) -> Any:
        witness = listener
        try:
            value = super().__getitem__(key)
        except KeyError:
            if witness is not None:
                witness.env_read(_text(key), None)
            raise
        if witness is not None:
            witness.env_read(_text(key), _text(value))
        return value

    def __iter__(self) -> Iterator[Any]:
        if listener is not None:
            listener.whole_env()
        return super().__iter__()


def _text(value: Any) -> str:
    return os.fsdecode(value) if isinstance(value, bytes) else str(value)


class WatchedMain(types.ModuleType):
    def __getattribute__(self, name: str) -> Any:
        # (``import __main__`` itself reads its ``__spec__``, from the import system's C code.)
        if listener is not None and name not in ("__class__", "__dict__", "__spec__"):
            listener.main_read(name)
        return super().__getattribute__(name)


class WatchedArgv(List[str]):
    def _saw(self) -> None:
        if listener is not None:
            listener.argv_read()

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
