"""The zygote: a warm Python process that has the heavy imports done once, and forks a
child per request, so that a new process costs a fork instead of an interpreter start and
an ``import torch``.

The zygote is started by the supervisor like any child (own process group, parent-death
signal). It never runs user threads or initialises CUDA, and it forks with
``clone(CLONE_PARENT)``: each child is a child of *our* process, so the supervisor waits for
it through a pidfd and sees its real exit status, and its parent-death signal follows our
supervisor thread. Each child then does what a spawn child does (own process group,
``__main__`` and the user's modules imported afresh), with the parent's current
environment, working directory and standard streams.

Protocol on the zygote's socket (a stream ``socketpair``), each message a kind byte and a
length, then the body:
- zygote to parent: READY (pickled preload failures) once imports are done; per request,
  one PID per child forked, then DONE, or ERROR with a text;
- parent to zygote: a request, with fds attached (SCM_RIGHTS): the parent's standard
  streams, the fds the arguments pass (multiprocessing primitives, shared tensors), and one
  report pipe per child, each to be placed at a given fd number in the child."""

from __future__ import annotations

import atexit
import fcntl
import importlib
import multiprocessing.spawn
import os
import pickle
import select
import site
import socket
import struct
import subprocess
import sys
import threading
import traceback
import warnings
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from . import _child, _native

_MESSAGE = struct.Struct("<BQ")
READY, PID, DONE, ERROR, REQUEST = range(1, 6)
#: Most fds one request may pass.
_MAX_FDS = 250


class ZygoteError(RuntimeError):
    """The zygote failed or died while starting processes. ``pids`` are the children it had
    already started for that request (the caller stops them)."""

    def __init__(self, message: str, pids: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.pids = list(pids)


# Messages -------------------------------------------------------------------------------


def _send(sock: socket.socket, kind: int, body: bytes = b"", fds: Sequence[int] = ()) -> None:
    head = _MESSAGE.pack(kind, len(body))
    if fds:
        socket.send_fds(sock, [head], list(fds))
    else:
        sock.sendall(head)
    sock.sendall(body)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> Tuple[int, bytes, List[int]]:
    """One message and the fds that came with it. Raises EOFError when the peer is gone."""
    head, fds, _, _ = socket.recv_fds(sock, _MESSAGE.size, _MAX_FDS)
    if not head:
        raise EOFError
    head += _recv_exact(sock, _MESSAGE.size - len(head))
    kind, size = _MESSAGE.unpack(head)
    return kind, _recv_exact(sock, size), fds


# The zygote process ---------------------------------------------------------------------


def _preload(modules: Sequence[str]) -> List[Tuple[str, str]]:
    """Imports each module; returns (module, error) for those that fail."""
    failures = []
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # an import may even call sys.exit
            failures.append((name, f"{type(exc).__name__}: {exc}"))
    return failures


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
    """Entry point of the zygote: ``python -c 'from tether._zygote import main; main()'``."""
    sock = socket.socket(fileno=int(os.environ.pop("TETHER_ZYGOTE_FD")))
    os.close(int(os.environ.pop("TETHER_REPORT_FD")))
    payload_fd = int(os.environ.pop("TETHER_PAYLOAD_FD"))
    config = pickle.loads(_child._read_all(payload_fd))
    os.close(payload_fd)
    sys.path[:] = config["sys_path"]
    failures = _preload(config["preload"])
    _quiesce()
    threads = len(os.listdir("/proc/self/task"))
    _send(sock, READY, pickle.dumps({"failures": failures, "threads": threads}))
    parent = os.getppid()
    while True:
        try:
            kind, body, fds = _recv(sock)
        except EOFError:
            os._exit(0)
        if kind == REQUEST:
            _serve(sock, pickle.loads(body), fds, parent)
        for fd in fds:
            os.close(fd)


def _serve(sock: socket.socket, request: Dict, fds: List[int], parent: int) -> None:
    """Forks one child per rank of the request, telling the parent each pid at once."""
    shared = len(request["targets"])
    try:
        for n, rank in enumerate(request["ranks"]):
            pid = _native.zygote_fork()
            if pid == 0:
                _become_child(sock, request, fds[:shared] + [fds[shared + n]], rank, parent)
            _send(sock, PID, struct.pack("<i", pid))
    except Exception:
        _send(sock, ERROR, traceback.format_exc().encode())
    else:
        _send(sock, DONE)


def _become_child(sock: socket.socket, request: Dict, fds: List[int], rank: int, parent: int):
    """In a new child of the zygote: become a clean process, then run the user's function.
    Never returns."""
    code = 1
    try:
        sock.close()
        _native.setup_forked_child(parent, True)
        report_target = request["report_targets"][rank]
        _place_fds(fds, request["targets"] + [report_target])
        os.set_inheritable(report_target, False)
        os.environb.clear()
        os.environb.update(request["env"])
        _child.reset_after_fork()
        _reseed()
        code = _child.run_payload(request["prep"], request["work"], rank, report_target)
    except BaseException:
        traceback.print_exc()
    finally:
        _child.exit_forked(code, run_atexit=True)


def _place_fds(fds: List[int], targets: List[int]) -> None:
    """Puts each received fd at its target number and closes every other fd but 0, 1, 2."""
    base = max([2, *fds, *targets]) + 1
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, base) for fd in fds]
    keep = sorted(high)
    low = 3
    for fd in keep:
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))
    for fd, target in zip(high, targets):
        os.dup2(fd, target)
        os.close(fd)


#: The seed torch gives its default generator in a new process, in builds that do not
#: draw one at random.
_TORCH_FIXED_SEED = 67280421310721


def _reseed() -> None:
    """A fresh process's random state. Python's ``random`` reseeds itself after a fork;
    numpy's global generator does not; torch's default generator starts as in a new
    process: from a fresh random seed, or from its fixed default seed in builds that use
    one (the zygote never draws from it, so that state is still untouched)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "initial_seed"):
        if torch.initial_seed() != _TORCH_FIXED_SEED:
            torch.seed()


# The parent's side ----------------------------------------------------------------------


def _site_dirs() -> List[str]:
    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    dirs += [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))]
    return sorted({os.path.realpath(d) + os.sep for d in dirs if d})


def installed_modules() -> Tuple[str, ...]:
    """The top-level installed third-party packages (from site-packages) imported so far."""
    dirs = tuple(_site_dirs())
    names = set()
    for name, module in list(sys.modules.items()):
        if "." in name or name in ("__main__", "__mp_main__"):
            continue
        path = getattr(module, "__file__", None)
        if path and os.path.realpath(path).startswith(dirs):
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
    """The parent's handle on one zygote (one per interpreter and preload set)."""

    def __init__(self, preload: Tuple[str, ...]) -> None:
        self.preload = preload
        self._lock = threading.Lock()
        self._group: Optional[_native.Group] = None
        self._sock: Optional[socket.socket] = None
        self._ready = False

    @property
    def pid(self) -> Optional[int]:
        return None if self._group is None else self._group.pid(0)

    def start(self) -> None:
        """Starts the zygote process if it is not running; returns at once (the imports
        happen in the background)."""
        with self._lock:
            self._ensure_started()

    def _alive(self) -> bool:
        """Running and connected: a zygote that died leaves its socket readable (at end of
        file) before the supervisor may have seen its exit."""
        if self._group is None or self._sock is None or self._group.exit(0) is not None:
            return False
        return not select.select([self._sock], [], [], 0)[0] or not self._ready

    def _ensure_started(self) -> None:
        if self._alive():
            return
        if self._group is not None:
            warnings.warn(f"{self._describe_death()}; starting a new one", RuntimeWarning, 3)
            self._close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [multiprocessing.spawn.get_executable()]
        argv += subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
        argv += ["-c", "from tether._zygote import main; main()"]
        config = pickle.dumps({"preload": self.preload, "sys_path": list(sys.path)})
        env = [(b"TETHER_ZYGOTE_FD", str(theirs.fileno()).encode())]
        group = _native.Group()
        try:
            group.launch([([os.fsencode(a) for a in argv], env, [theirs.fileno()], config)])
        finally:
            theirs.close()
        self._group, self._sock, self._ready = group, ours, False

    def _describe_death(self) -> str:
        assert self._group is not None
        self._group.wait(None, "all", 1.0)
        status = self._group.exit(0)
        how = "is not answering"
        if status is not None:
            code, signame, _, _ = status
            how = f"died with signal {signame}" if signame else f"exited with code {code}"
        return f"the tether zygote (pid {self._group.pid(0)}) {how}"

    def _await_ready(self) -> None:
        if self._ready:
            return
        assert self._sock is not None
        try:
            kind, body, _ = _recv(self._sock)
        except (EOFError, OSError) as exc:
            message = f"{self._describe_death()} while importing {list(self.preload)}"
            raise ZygoteError(message) from exc
        info = pickle.loads(body)
        for module, error in info["failures"]:
            warnings.warn(
                f"tether zygote: cannot preload module {module!r} ({error}); "
                "children will import it themselves",
                RuntimeWarning,
                4,
            )
        if info["threads"] > 1:
            warnings.warn(
                f"tether zygote: preloading {list(self.preload)} started "
                f"{info['threads'] - 1} thread(s); forking such a process is unsafe",
                RuntimeWarning,
                4,
            )
        self._ready = True

    def fork(
        self,
        ranks: Sequence[int],
        fds: Sequence[int],
        targets: Sequence[int],
        report_fds: Sequence[int],
        prep: bytes,
        work: bytes,
    ) -> List[int]:
        """Starts one child per rank; returns their pids. The children get ``fds`` at the
        numbers ``targets`` and their report pipe at the number of the parent's fd."""
        request = {
            "ranks": list(ranks),
            "targets": list(targets),
            "report_targets": {rank: fd for rank, fd in zip(ranks, report_fds)},
            "env": dict(os.environb),
            "prep": prep,
            "work": work,
        }
        body = pickle.dumps(request)
        with self._lock:
            for attempt in (1, 2):
                self._ensure_started()
                self._await_ready()
                assert self._sock is not None
                try:
                    _send(self._sock, REQUEST, body, [*fds, *report_fds])
                    break
                except OSError as exc:
                    # It died before it read the request, so it started nothing: once more
                    # with a new zygote.
                    if attempt == 2:
                        message = f"{self._describe_death()} while starting processes"
                        raise ZygoteError(message) from exc
            pids: List[int] = []
            try:
                while True:
                    kind, reply, _ = _recv(self._sock)
                    if kind == PID:
                        pids.append(struct.unpack("<i", reply)[0])
                    elif kind == DONE:
                        return pids
                    else:
                        raise ZygoteError(
                            f"the tether zygote failed to start a process:\n{reply.decode()}", pids
                        )
            except (EOFError, OSError) as exc:
                message = f"{self._describe_death()} while starting processes {list(ranks)}"
                raise ZygoteError(message, pids) from exc

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        if self._group is not None and not self._group.wait(None, "all", 1.0):
            self._group.signal_all(9)
            self._group.wait(None, "all", 5.0)
        self._group = self._sock = None

    def close(self) -> None:
        """Stops the zygote (children it started are not affected)."""
        with self._lock:
            self._close()


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


def warm_up(preload: Optional[Iterable[str]] = None) -> None:
    """Starts the zygote now, in the background, so that its imports overlap the caller's
    own start-up; the first ``forkserver`` start then finds it ready."""
    get(preload).start()


def pids() -> List[int]:
    """The pids of this process's running zygotes."""
    with _zygotes_lock:
        zygotes = [z for (pid, _, _), z in _zygotes.items() if pid == os.getpid()]
    return [z.pid for z in zygotes if z.pid is not None]


@atexit.register
def shutdown() -> None:
    """Stops every zygote of this process."""
    with _zygotes_lock:
        zygotes = [z for (pid, _, _), z in _zygotes.items() if pid == os.getpid()]
        _zygotes.clear()
    for zygote in zygotes:
        zygote.close()
