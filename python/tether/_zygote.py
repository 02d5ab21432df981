"""The zygote: a warm Python process that has the heavy imports done once, and forks a
child per request, so that a new process costs a fork instead of an interpreter start and
an ``import torch``.

The protocol is tether-core's (``_native.Zygote`` in the parent, ``_native.zygote_serve`` in
the zygote): requests, fds in batches, the children forked ahead ("blanks"), the caller's
process attributes, supervision of every child by pidfd. What stays here is what must be
Python: choosing and importing the preload, and, in each child, installing the caller's
environment, fresh random state and running the payload."""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import os
import pickle
import site
import sys
import sysconfig
import threading
import warnings
from typing import (
    Dict,
    FrozenSet,
    Iterable,
    Iterator,
    List,
    NoReturn,
    Optional,
    Sequence,
    Tuple,
)

from . import _child, _launch, _native
from ._log import logger

ZygoteError = _native.ZygoteError


#: Where a zygote that started again without some modules finds its configuration.
_CONFIG_ENV = "TETHER_ZYGOTE_CONFIG"


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _preload(modules: Sequence[str]) -> Tuple[List[Tuple[str, str]], List[str]]:
    """Imports each module; returns (module, error) for those that fail, and the modules
    whose import left a thread running (one that a throwaway fork, see ``_quiesce``, does
    not wind down): forking a process with another thread copies the locks that thread
    holds, held for ever in every child."""
    failures = []
    threaded = []
    for name in modules:
        before = _threads()
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - an import may even call sys.exit
            failures.append((name, f"{type(exc).__name__}: {exc}"))
        if _threads() > before:
            _quiesce()
            if _threads() > before:
                threaded.append(name)
    return failures, threaded


@contextlib.contextmanager
def _output_dropped() -> Iterator[None]:
    """Sends what is written on stdout and stderr meanwhile (a package that prints or warns
    at import) to /dev/null: the zygote never writes on the user's streams, and the parent,
    which imported the same packages, has shown it already."""

    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):
                pass
        try:
            import ctypes

            ctypes.CDLL(None).fflush(None)  # what C code buffered in stdio
        except (OSError, AttributeError):
            pass

    flush()
    saved: Dict[int, Optional[int]] = {}
    for fd in (1, 2):
        try:
            saved[fd] = os.dup(fd)
        except OSError:
            saved[fd] = None  # closed: it stays closed afterwards
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            os.dup2(null, fd)
    finally:
        os.close(null)
    try:
        yield
    finally:
        flush()
        for fd, copy in saved.items():
            if copy is None:
                os.close(fd)
            else:
                os.dup2(copy, fd)
                os.close(copy)


def _start_again_without(config: Dict[str, object], fds: Sequence[int]) -> NoReturn:
    """Replaces this zygote (same pid, same fds ``fds``) by a fresh one whose preload leaves
    out the modules in ``config["left_out"]``; its threads do not survive the exec."""
    import base64

    for fd in fds:
        os.set_inheritable(fd, True)
    env = dict(os.environ)
    env[_CONFIG_ENV] = base64.b64encode(pickle.dumps(config)).decode()
    argv = _launch.python_argv("from tether._zygote import main; main()")
    os.execve(argv[0], argv, env)


def _quiesce() -> None:
    """Lets libraries stop the threads their imports started. Children are made with a raw
    ``clone``, which runs no ``pthread_atfork`` handlers; a plain fork does, and libraries
    use them to wind down their thread pools (OpenBLAS, loaded with numpy, joins its
    workers). One throwaway fork leaves the zygote single-threaded."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def main() -> None:
    """Entry point of the zygote: ``python -c 'from tether._zygote import main; main()'``.
    An unexpected error goes to the zygote's report pipe (the parent shows it), never to
    the terminal."""
    report_fd = int(os.environ.pop("TETHER_REPORT_FD"))
    try:
        fds_value = os.environ.pop(_native.ZYGOTE_FDS_ENV)
        request_fd, notices_fd = map(int, fds_value.split(","))
        again = os.environ.pop(_CONFIG_ENV, None)
        if again is None:
            payload_fd = int(os.environ.pop("TETHER_PAYLOAD_FD"))
            config = pickle.loads(_child._read_all(payload_fd))
            os.close(payload_fd)
        else:
            import base64

            config = pickle.loads(base64.b64decode(again))
        left_out: List[str] = config.setdefault("left_out", [])
        preload = [m for m in config["preload"] if m not in left_out]
        sys.path[:] = config["sys_path"]
        _name_zygote(preload)
        with _output_dropped():
            failures, threaded = _preload(preload)
        if threaded and len(left_out) < 3 * len(config["preload"]):
            # Start again without them: a thread cannot be stopped from outside, and a
            # zygote must fork from a single thread.
            config["left_out"] = left_out + threaded
            os.environ["TETHER_REPORT_FD"] = str(report_fd)
            os.environ[_native.ZYGOTE_FDS_ENV] = fds_value
            _start_again_without(config, [report_fd, request_fd, notices_fd])
        _quiesce()
        # What the zygote holds now is shared by every child, page for page, until written
        # to: keep the garbage collector from walking it (and copying every page it visits)
        # in each child.
        gc.freeze()
        threads = len(os.listdir("/proc/self/task"))
        ready = pickle.dumps({"failures": failures, "threads": threads, "left_out": left_out})
        served = _native.zygote_serve(
            request_fd, notices_fd, os.getppid(), ready, config["reserve"]
        )
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, not the terminal
        _report_and_exit(report_fd, exc)
    if isinstance(served, int):
        os._exit(served)
    _run_job(served)


def preload_summary(preload: Sequence[str], shown: int = 6) -> str:
    """The preload list in a few words, installed packages (torch, numpy) first."""
    stdlib: FrozenSet[str] = getattr(sys, "stdlib_module_names", frozenset())
    names = sorted((m for m in preload if not m.startswith("_")), key=lambda m: (m in stdlib, m))
    hidden = len(preload) - min(shown, len(names))
    text = ", ".join(names[:shown])
    return (text + (f", +{hidden} more" if hidden else "")) or "nothing"


def preload_words(preload: Sequence[str]) -> str:
    """How many modules the preload has, and a few of them: ``412 modules (torch, numpy,
    ..., +406 more)``."""
    count = len(preload)
    return f"{count} module{'' if count == 1 else 's'} ({preload_summary(preload)})"


def _name_zygote(preload: Sequence[str]) -> None:
    title = f"tether zygote of pid {os.getppid()} (preload: {preload_summary(preload)})"
    try:
        _native.set_title(title, "tether-zygote")
    except OSError:
        pass


def _report_and_exit(report_fd: int, exc: BaseException) -> NoReturn:
    from . import _report

    try:
        _report.write(report_fd, exc)
    finally:
        os._exit(1)


def _run_job(job: _native.Job) -> NoReturn:
    """In a new child: take the caller's environment and a fresh random state, then run the
    payload's function for the job's rank; never returns."""
    code = 1
    try:
        report_fd = job.take_report_fd()
        _take_environment(dict(job.env))
        _child.reset_after_fork()
        _reseed()
        _, prep, work = _child.split_payload(job.take_payload())
        code = _child.run_payload(prep, work, job.rank, report_fd, job.error)
    finally:
        _child.exit_forked(code)


def _take_environment(env: Dict[bytes, bytes]) -> None:
    """Makes this process's environment ``env``, touching only the variables that differ
    (each change is a libc call that scans the whole environment)."""
    current = os.environb
    for name in [name for name in current if name not in env]:
        del current[name]
    for name, value in env.items():
        if current.get(name) != value:
            current[name] = value


#: The seed torch gives its default generator in a new process, in builds that do not
#: draw one at random.
_TORCH_FIXED_SEED = 67280421310721


def _reseed() -> None:
    """A fresh process's random state. Python's ``random`` reseeds itself after a fork;
    numpy's global generator, if the zygote has loaded it, does not; torch's default
    generator starts as in a new process: from a fresh random seed, or from its fixed
    default seed in builds that use one (the zygote never draws from it, so that state is
    still untouched)."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:  # else the child's first use imports and seeds it afresh
        numpy_random.seed()
    torch = sys.modules.get("torch")
    generator = getattr(torch, "default_generator", None)
    if generator is not None and generator.initial_seed() != _TORCH_FIXED_SEED:
        generator.seed()


# The parent's side ----------------------------------------------------------------------


def _site_dirs() -> List[str]:
    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    dirs += [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))]
    return sorted({os.path.realpath(d) + os.sep for d in dirs if d})


def _stdlib_dirs() -> List[str]:
    paths = sysconfig.get_paths()
    return sorted({os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib")})


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
            broken = process.broken()
            if broken is None and process.exit() is not None:
                broken = f"the tether zygote (pid {process.pid}) died with {process.exit()}"
            if broken is not None and not broken.endswith("was closed"):
                warnings.warn(f"{broken}; starting a new one", RuntimeWarning, 4)
            process.close(0.0)
        config = {"preload": self.preload, "sys_path": list(sys.path), "reserve": reserve}
        argv = _launch.python_argv("from tether._zygote import main; main()")
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
        shared: Sequence[Tuple[int, int]],
        payload: bytes,
    ) -> None:
        """Starts one child per rank into ``group``, each getting the fds ``shared`` as
        ``(fd, number in the child)``. A zygote found dead before it started anything is
        replaced once."""
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
                    if attempt == 2 or len(group) != before or not process.vanished():
                        raise

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


@atexit.register
def shutdown() -> None:
    """Stops every zygote of this process."""
    with _zygotes_lock:
        zygotes = [z for (pid, _, _), z in _zygotes.items() if pid == os.getpid()]
        _zygotes.clear()
    for zygote in zygotes:
        zygote.close()
