"""The zygote: a warm Python process that has the heavy imports done once, and forks a
child per request, so that a new process costs a fork instead of an interpreter start and
an ``import torch``.

The protocol is tether-core's (``_native.Zygote`` in the parent, ``_native.zygote_serve`` in
the zygote): requests, fds in batches, the children forked ahead ("blanks"), the caller's
process attributes, supervision of every child by pidfd. What stays in Python is what must
be: here, the parent's side (choosing the preload, one zygote per preload set, started
again when it died, its warnings); in ``server``, the zygote process itself
(importing the preload, and, in each child, installing the caller's environment, fresh
random state and running the payload).

The blanks a zygote keeps ready are processes of this process's user: they count against
its ``RLIMIT_NPROC``. The zygote keeps them within half of what this process's limits would
leave without them (it reads them from this process), and this process tells it of a new
process limit before it takes effect: once a zygote has started, ``resource.setrlimit`` and
``resource.prlimit`` of ``RLIMIT_NPROC`` on this process (seen through an audit hook) return
only once every zygote of it holds no more blanks than the new limit leaves room for, so that
the thread or process started next finds that room."""

from __future__ import annotations

import atexit
import os
import pickle
import resource
import site
import sys
import sysconfig
import threading
import warnings
from typing import (
    Any,
    Dict,
    Iterable,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
)

from tether import _native
from tether.common.log import logger
from tether.spawn import bootstrap

from . import server

ZygoteError = _native.ZygoteError


def preload_words(preload: Sequence[str]) -> str:
    """How many modules the preload has, and a few of them: ``412 modules (torch, numpy,
    ..., +406 more)``."""
    count = len(preload)
    return f"{count} module{'' if count == 1 else 's'} ({server.preload_summary(preload)})"


# The parent's side ----------------------------------------------------------------------


def _site_dirs() -> List[str]:
    """Where installed packages live: the site directories, and any folder on ``sys.path``
    that holds installed distributions (``pip install --target DIR`` on ``PYTHONPATH``), but
    the script's own (``sys.path[0]``)."""
    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    dirs += [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))]
    dirs += [p for p in sys.path[1:] if p and _holds_distributions(p)]
    return sorted({os.path.realpath(d) + os.sep for d in dirs if d})


def _holds_distributions(folder: str) -> bool:
    try:
        with os.scandir(folder) as entries:
            return any(e.name.endswith(".dist-info") for e in entries)
    except OSError:
        return False


def _stdlib_dirs() -> List[str]:
    return list(_STDLIB_DIRS)


_PATHS = sysconfig.get_paths()
#: Where the standard library lives (read once: sysconfig imports more the first time).
_STDLIB_DIRS = sorted({os.path.realpath(_PATHS[k]) + os.sep for k in ("stdlib", "platstdlib")})


def installed_modules() -> Tuple[str, ...]:
    """The top-level modules imported so far that are installed packages (site-packages)
    or part of the standard library: never the user's own. A child still imports its own
    copy of anything else, as a spawn child would."""
    installed = tuple(_site_dirs())
    stdlib = tuple(_stdlib_dirs())
    names = set()
    for name, module in list(sys.modules.items()):
        if "." in name or name in ("__main__", "__mp_main__"):
            continue
        path = getattr(module, "__file__", None)
        if not path:
            continue
        path = os.path.realpath(path)
        if path.startswith(installed) or (path.startswith(stdlib) and "-packages" not in path):
            names.add(name)
    return tuple(sorted(names))


def own_modules() -> List[str]:
    """The modules of tether this process has imported (never ``tether.__main__``, which is
    a command): the zygote imports them as well, so that a child whose ``__main__`` imports
    one (``from tether import Pool``) finds it there instead of importing it anew."""
    prefix = __name__.split(".")[0] + "."
    modules = list(sys.modules.items())
    return sorted(
        name
        for name, module in modules
        if name.startswith(prefix) and name != prefix + "__main__" and module is not None
    )


_preload_override: Optional[Tuple[str, ...]] = None


def set_preload(modules: Optional[Iterable[str]]) -> None:
    """Chooses the modules a zygote imports before it forks children (None restores the
    default: the installed third-party packages the process has imported)."""
    global _preload_override
    _preload_override = None if modules is None else tuple(modules)


def _chosen_preload(preload: Optional[Iterable[str]]) -> Optional[Tuple[str, ...]]:
    """The preload set asked for, or None for the default (decided when it starts)."""
    if preload is not None:
        return tuple(preload)
    return _preload_override


class Zygote:
    """The parent's handle on one zygote (one per interpreter and preload set): started on
    first use, and started anew when it died, stopped answering, or was started with lower
    resource limits than this process has now."""

    def __init__(self, preload: Tuple[str, ...]) -> None:
        self.preload = preload
        self._lock = threading.Lock()
        self._process: Optional[_native.Zygote] = None
        self._ready = False

    @property
    def pid(self) -> Optional[int]:
        process = self._process
        return None if process is None or process.exit() is not None else process.pid

    def pids(self) -> List[int]:
        """The zygote's pid while it runs, and those of its blank children until they are
        reaped (those of a zygote that died exit as soon as they notice)."""
        process = self._process
        if process is None:
            return []
        alive = [process.pid] if process.exit() is None else []
        return [*alive, *process.blanks()]

    def start(self, reserve: int = 0) -> None:
        """Starts the zygote process if it is not running, with ``reserve`` children forked
        ahead; returns at once (the imports happen in the background)."""
        with self._lock:
            self._ensure_started(reserve)

    def _ensure_started(self, reserve: int = 0) -> _native.Zygote:
        process = self._process
        if process is not None and process.usable():
            return process
        if process is not None:
            failure = process.failure()
            if failure is not None and failure.kind != _native.ZygoteFailureKind.CLOSED:
                warnings.warn(f"{failure.message}; starting a new one", RuntimeWarning, 4)
            process.close(0.0)
        config = {
            "preload": self.preload,
            "own": own_modules(),
            "sys_path": list(sys.path),
            "reserve": reserve,
        }
        _watch_the_process_limit()
        argv = bootstrap.python_argv(server.ENTRY)
        self._process = _native.Zygote(argv, [], pickle.dumps(config))
        self._ready = False
        logger.info(
            "started the zygote (pid %d), preloading %s",
            self._process.pid,
            preload_words(self.preload),
        )
        return self._process

    def _await_ready(self, process: _native.Zygote) -> None:
        if self._ready:
            return
        try:
            info = pickle.loads(process.wait_ready())
        except ZygoteError as exc:
            raise ZygoteError(f"{exc} while importing {preload_words(self.preload)}") from None
        for module, error in info["failures"]:
            warnings.warn(
                f"tether zygote: cannot preload module {module!r} ({error}); "
                "children will import it themselves",
                RuntimeWarning,
                5,
            )
        for module in info.get("left_out", ()):
            warnings.warn(
                f"tether zygote: left {module!r} out of the preload: importing it started a "
                "thread, and forking a process that has another thread can leave a lock "
                "held for ever in every child; forkserver children import it themselves",
                RuntimeWarning,
                5,
            )
        if info["threads"] > 1:
            warnings.warn(
                f"tether zygote: preloading {list(self.preload)} started "
                f"{info['threads'] - 1} thread(s); forking such a process is unsafe",
                RuntimeWarning,
                5,
            )
        self._ready = True

    def fork(
        self,
        group: _native.Group,
        ranks: Sequence[int],
        shared: Sequence[_native.SharedFd],
        payload: bytes,
    ) -> None:
        """Starts one child per rank into ``group``, each getting the fds ``shared``. A
        zygote found dead before it started anything is replaced once."""
        with self._lock:
            for attempt in (1, 2):
                process = self._ensure_started()
                before = len(group)
                try:
                    self._await_ready(process)
                    process.fork(group, list(ranks), list(shared), payload)
                    return
                except ZygoteError:
                    # Once more only for a zygote that had died before it started anything;
                    # one stopped for not answering fails this start.
                    failure = process.failure()
                    died = failure is not None and failure.kind == _native.ZygoteFailureKind.DIED
                    if attempt == 2 or len(group) != before or not died:
                        raise

    def make_room(self, limit: Optional[int]) -> None:
        """This process is about to set its soft RLIMIT_NPROC to ``limit`` (None:
        unlimited): returns once the zygote's blanks fit in the room that leaves."""
        with self._lock:
            if self._process is not None:
                self._process.make_room(limit)

    def close(self) -> None:
        """Stops the zygote (children it started are not affected)."""
        with self._lock:
            if self._process is not None:
                self._process.close(1.0)
                self._process = None


_zygotes: Dict[Tuple[int, str, Optional[Tuple[str, ...]]], Zygote] = {}
_zygotes_lock = threading.Lock()


def get(preload: Optional[Iterable[str]] = None) -> Zygote:
    """The zygote of this process for the preload set (started lazily on first use). The
    default zygote preloads the installed packages imported when it is first asked for,
    and serves every later default request."""
    chosen = _chosen_preload(preload)
    key = (os.getpid(), sys.executable, chosen)
    with _zygotes_lock:
        zygote = _zygotes.get(key)
        if zygote is None:
            modules = installed_modules() if chosen is None else chosen
            zygote = _zygotes[key] = Zygote(modules)
    return zygote


def warm_up(preload: Optional[Iterable[str]] = None, processes: int = 0) -> None:
    """Starts the zygote now, in the background, so that its imports overlap the caller's
    own start-up; the first ``forkserver`` start then finds it ready. ``processes``
    children are forked ahead of time, so that a first start of that many costs no fork."""
    get(preload).start(processes)


def running() -> List[Zygote]:
    """This process's zygotes."""
    with _zygotes_lock:
        return [z for (pid, _, _), z in _zygotes.items() if pid == os.getpid()]


def pids() -> List[int]:
    """The pids of this process's running zygotes and of the children they keep ready."""
    return [pid for z in running() for pid in z.pids()]


#: The processes whose zygotes hear of a new RLIMIT_NPROC (a fork child inherits the hook,
#: not the watch: it takes no lock its parent's threads may have held at the fork).
_watching: Set[int] = set()
_hooked = False


def _watch_the_process_limit() -> None:
    """Has the audit hook tell this process's zygotes of a new RLIMIT_NPROC before it takes
    effect (see the module's documentation); the hook is installed once per interpreter."""
    global _hooked
    _watching.add(os.getpid())
    if not _hooked:
        _hooked = True
        sys.addaudithook(_on_audit)


def _on_audit(event: str, args: Tuple[Any, ...]) -> None:
    # Called for every audited event of the process: the first test is all most pay. An
    # exception here would fail the call audited; none leaves.
    if event != "resource.setrlimit" and event != "resource.prlimit":
        return
    if os.getpid() not in _watching:
        return
    try:
        if event == "resource.prlimit":
            pid, which, limits = args
            if pid not in (0, os.getpid()):
                return
        else:
            which, limits = args
        if which != resource.RLIMIT_NPROC or limits is None:
            return
        soft = int(limits[0])
        limit = None if soft == resource.RLIM_INFINITY or soft < 0 else soft
        for zygote in running():
            zygote.make_room(limit)
    except Exception as exc:  # noqa: BLE001 - the caller's call must go on
        logger.info("could not tell the zygote of a new process limit: %s", exc)


@atexit.register
def shutdown() -> None:
    """Stops every zygote of this process."""
    with _zygotes_lock:
        zygotes = [z for (pid, _, _), z in _zygotes.items() if pid == os.getpid()]
        _zygotes.clear()
    for zygote in zygotes:
        zygote.close()
