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
import gc
import importlib
import multiprocessing.spawn
import os
import pickle
import select
import signal
import site
import socket
import struct
import subprocess
import sys
import sysconfig
import threading
import traceback
import warnings
from typing import Callable, Dict, Iterable, List, NoReturn, Optional, Sequence, Set, Tuple

from . import _child, _native

_MESSAGE = struct.Struct("<BQ")
READY, PID, DONE, ERROR, REQUEST, RESERVE = range(1, 7)
#: Most blank children a zygote keeps ready.
MAX_RESERVE = 64
#: How long the zygote waits, idle, before it forks blanks to replace those used.
REPLENISH_DELAY = 0.05
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
        sock.sendall(body)
    else:
        sock.sendall(head + body)  # one write: small messages arrive whole


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
    # What the zygote holds now is shared by every child, page for page, until written to:
    # keep the garbage collector from walking it (and copying every page it visits) in each
    # child.
    gc.freeze()
    threads = len(os.listdir("/proc/self/task"))
    _send(sock, READY, pickle.dumps({"failures": failures, "threads": threads}))
    _Server(sock, os.getppid(), config["reserve"]).run()


class _Server:
    """The zygote's loop. Between requests it keeps ``target`` blank children ready: forked
    already, waiting on a private socket for their work, so that a request costs no fork
    (the target grows to the largest request seen, up to ``MAX_RESERVE``). The parent is
    told each blank's pid (RESERVE), so that it can reap the blanks that never get work."""

    def __init__(self, sock: socket.socket, parent: int, target: int) -> None:
        self.sock = sock
        self.parent = parent
        self.target = min(target, MAX_RESERVE)
        self.blanks: List[Tuple[int, socket.socket]] = []

    def run(self) -> None:
        while True:
            # Forking blanks costs CPU that the children just started need: wait until the
            # zygote has been idle a moment (or a request comes) before replenishing.
            if not select.select([self.sock], [], [], REPLENISH_DELAY)[0]:
                self.replenish()
            try:
                kind, body, fds = _recv(self.sock)
            except EOFError:
                for _, channel in self.blanks:
                    channel.close()  # each blank sees the end of file and exits
                os._exit(0)
            try:
                if kind == REQUEST:
                    self.serve(body, fds)
            finally:
                for fd in fds:
                    os.close(fd)

    def serve(self, body: bytes, fds: List[int]) -> None:
        """Starts one child per rank of the request, telling the parent each pid at once."""
        request = pickle.loads(body)
        shared = len(request["targets"])
        self.target = min(max(self.target, len(request["ranks"])), MAX_RESERVE)
        try:
            for n, rank in enumerate(request["ranks"]):
                own = fds[:shared] + [fds[shared + n]]
                pid = self.activate(body, rank, own) or self.fork_now(request, rank, own)
                _send(self.sock, PID, struct.pack("<i", pid))
        except Exception:
            _send(self.sock, ERROR, traceback.format_exc().encode())
        else:
            _send(self.sock, DONE)

    def activate(self, body: bytes, rank: int, fds: List[int]) -> Optional[int]:
        """Hands the work to a blank child; None when none is left."""
        while self.blanks:
            pid, channel = self.blanks.pop(0)
            try:
                _send(channel, REQUEST, struct.pack("<I", rank) + body, fds)
                return pid
            except OSError:
                continue  # that blank died; the parent reaps it with the others
            finally:
                channel.close()
        return None

    def fork_now(self, request: Dict, rank: int, fds: List[int]) -> int:
        pid = _native.zygote_fork()
        if pid == 0:
            code = 1
            try:
                _native.setup_forked_child(self.parent, True)
                code = _run_request(request, fds, rank)
            finally:
                _child.exit_forked(code)
        return pid

    def replenish(self) -> None:
        """Forks blanks up to the target, stopping early when a request is waiting."""
        while len(self.blanks) < self.target and not select.select([self.sock], [], [], 0)[0]:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            pid = _native.zygote_fork()
            if pid == 0:
                _wait_for_work(theirs, self.parent)
            theirs.close()
            self.blanks.append((pid, ours))
            _send(self.sock, RESERVE, struct.pack("<i", pid))


def _wait_for_work(channel: socket.socket, parent: int) -> NoReturn:
    """A blank child: wait for a request on ``channel`` (exit at its end), then run it."""
    code = 1
    try:
        _native.setup_forked_child(parent, True)
        _close_all_but([channel.fileno()])
        try:
            kind, body, fds = _recv(channel)
        except EOFError:
            os._exit(0)
        channel.close()
        (rank,) = struct.unpack_from("<I", body)
        code = _run_request(pickle.loads(body[4:]), fds, rank)
    except BaseException:
        traceback.print_exc()
    finally:
        _child.exit_forked(code)


def _run_request(request: Dict, fds: List[int], rank: int) -> int:
    """In a new child: take the parent's fds, environment and a fresh random state, then run
    the user's function; returns the exit status."""
    report_target = request["report_targets"][rank]
    _place_fds(fds, request["targets"] + [report_target])
    os.set_inheritable(report_target, False)
    os.environb.clear()
    os.environb.update(request["env"])
    _child.reset_after_fork()
    _reseed()
    return _child.run_payload(request["prep"], request["work"], rank, report_target)


def _close_all_but(keep: Sequence[int]) -> None:
    """Closes every fd above 2 but those in ``keep``."""
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def _place_fds(fds: List[int], targets: List[int]) -> None:
    """Puts each received fd at its target number and closes every other fd but 0, 1, 2."""
    base = max([2, *fds, *targets]) + 1
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, base) for fd in fds]
    _close_all_but(high)
    for fd, target in zip(high, targets):
        os.dup2(fd, target)
        os.close(fd)


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
    """The parent's handle on one zygote (one per interpreter and preload set)."""

    def __init__(self, preload: Tuple[str, ...]) -> None:
        self.preload = preload
        self._lock = threading.Lock()
        self._group: Optional[_native.Group] = None
        self._sock: Optional[socket.socket] = None
        self._ready = False
        #: Blank children the zygote has forked for later requests (ours to reap).
        self._reserve: Set[int] = set()

    @property
    def pid(self) -> Optional[int]:
        return None if self._group is None else self._group.pid(0)

    def pids(self) -> List[int]:
        """The zygote's pid and those of its blank children, if it runs."""
        with self._lock:
            if not self._alive():
                return []
            return [self._group.pid(0), *sorted(self._reserve)]  # type: ignore[union-attr]

    def start(self, reserve: int = 0) -> None:
        """Starts the zygote process if it is not running, with ``reserve`` children forked
        ahead; returns at once (the imports happen in the background)."""
        with self._lock:
            self._ensure_started(reserve)

    def _pending(self) -> bool:
        """Whether a whole message from the zygote is waiting. Raises EOFError at its end."""
        assert self._sock is not None
        peek = socket.MSG_PEEK | socket.MSG_DONTWAIT
        try:
            head = self._sock.recv(_MESSAGE.size, peek)
            if not head:
                raise EOFError
            if len(head) < _MESSAGE.size:
                return False
            size = _MESSAGE.size + _MESSAGE.unpack(head)[1]
            return len(self._sock.recv(size, peek)) == size
        except BlockingIOError:
            return False

    def _alive(self) -> bool:
        """Running and connected. Takes in the zygote's notices about blank children; a
        zygote that died is seen at the end of its socket before the supervisor may have
        seen its exit."""
        if self._group is None or self._sock is None or self._group.exit(0) is not None:
            return False
        if not self._ready:
            return True
        try:
            while self._pending():
                kind, body, _ = _recv(self._sock)
                if kind != RESERVE:
                    return False
                self._reserve.add(struct.unpack("<i", body)[0])
        except (EOFError, OSError):
            return False
        return True

    def _ensure_started(self, reserve: int = 0) -> None:
        if self._alive():
            return
        if self._group is not None:
            warnings.warn(f"{self._describe_death()}; starting a new one", RuntimeWarning, 3)
            self._close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [multiprocessing.spawn.get_executable()]
        argv += subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
        argv += ["-c", "from tether._zygote import main; main()"]
        config = {"preload": self.preload, "sys_path": list(sys.path), "reserve": reserve}
        env = [(b"TETHER_ZYGOTE_FD", str(theirs.fileno()).encode())]
        group = _native.Group()
        try:
            spec = ([os.fsencode(a) for a in argv], env, [theirs.fileno()], pickle.dumps(config))
            group.launch([spec])
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
        on_pid: Callable[[int, int], None],
    ) -> None:
        """Starts one child per rank, calling ``on_pid(n, pid)`` for the n-th as soon as it
        exists. The children get ``fds`` at the numbers ``targets`` and their report pipe
        at the number of the parent's fd."""
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
                    if kind == RESERVE:
                        self._reserve.add(struct.unpack("<i", reply)[0])
                    elif kind == PID:
                        pid = struct.unpack("<i", reply)[0]
                        self._reserve.discard(pid)
                        pids.append(pid)
                        on_pid(len(pids) - 1, pid)
                    elif kind == DONE:
                        return
                    else:
                        raise ZygoteError(
                            f"the tether zygote failed to start a process:\n{reply.decode()}", pids
                        )
            except (EOFError, OSError) as exc:
                message = f"{self._describe_death()} while starting processes {list(ranks)}"
                self._close()  # reaps the children it kept ready; the next call starts anew
                raise ZygoteError(message, pids) from exc

    def _close(self) -> None:
        """Stops the zygote and reaps the blank children it kept: at the end of its socket
        it closes theirs, and each exits."""
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_WR)
                self._sock.settimeout(5.0)
                while True:
                    kind, body, _ = _recv(self._sock)
                    if kind == RESERVE:
                        self._reserve.add(struct.unpack("<i", body)[0])
            except (EOFError, OSError):
                pass
            self._sock.close()
        if self._group is not None and not self._group.wait(None, "all", 1.0):
            self._group.signal_all(signal.SIGKILL)
            self._group.wait(None, "all", 5.0)
        for pid in self._reserve:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass  # already reaped (a SIGCHLD disposition of SIG_IGN does that)
        self._reserve.clear()
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


def warm_up(preload: Optional[Iterable[str]] = None, processes: int = 0) -> None:
    """Starts the zygote now, in the background, so that its imports overlap the caller's
    own start-up; the first ``forkserver`` start then finds it ready. ``processes``
    children are forked ahead of time, so that a first start of that many costs no fork."""
    get(preload).start(processes)


def pids() -> List[int]:
    """The pids of this process's running zygotes and of the children they keep ready."""
    with _zygotes_lock:
        zygotes = [z for (pid, _, _), z in _zygotes.items() if pid == os.getpid()]
    return [pid for z in zygotes for pid in z.pids()]


@atexit.register
def shutdown() -> None:
    """Stops every zygote of this process."""
    with _zygotes_lock:
        zygotes = [z for (pid, _, _), z in _zygotes.items() if pid == os.getpid()]
        _zygotes.clear()
    for zygote in zygotes:
        zygote.close()
