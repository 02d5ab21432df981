"""Shared fixtures: every test must leave no child process, fd, temp file or shared-memory
segment behind.

The check after each test looks only at what this test session owns, never at the whole
machine, so that other programs (another test run included) cannot make a test fail:

- processes: this process's children (zombies included) and every process that carries
  this session's marker in its environment (set below, inherited by every process the
  tests start, even one that left its parent's process tree), less the helpers that live
  for the whole session (the resource tracker, the zygotes and their ready children);
- fds: this process's own;
- temporary files: a private directory every process of the session uses (``TMPDIR``);
- shared memory: the ``/dev/shm`` entries that one of the session's processes holds open
  or mapped, or whose name carries the pid of one of them (torch names its segments
  ``torch_<pid>_...``; this process's semaphores are named ``sem.mp-tether<pid>-...``)."""

from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.process
import os
import re
import signal
import tempfile
import time
import uuid
from typing import Any, Dict, Iterable, Iterator, List, Set, Tuple

import pytest

#: Every process this session starts inherits this variable (children that import this
#: module keep their parent's).
MARKER_VAR = "TETHER_TESTS_SESSION"
_MARKER = os.environ.setdefault(MARKER_VAR, uuid.uuid4().hex)
_MARKER_BYTES = f"{MARKER_VAR}={_MARKER}".encode()

# Everything this session and its children put in the temporary directory lands in a
# private one, checked after every test and removed at the end.
_PRIVATE_TMP = os.environ.get("TETHER_TESTS_TMP") or tempfile.mkdtemp(prefix="tether-tests-")
os.environ["TETHER_TESTS_TMP"] = os.environ["TMPDIR"] = tempfile.tempdir = _PRIVATE_TMP

# multiprocessing names its semaphores "/dev/shm/sem.<semprefix>-<random>": put this
# process's pid in them, so that one left behind is recognised as ours.
multiprocessing.process.current_process()._config["semprefix"] = f"/mp-tether{os.getpid()}"

# Imported once the variables above are set (a tether child started by a test inherits them).
from tether.spawn.launch import START_METHODS  # noqa: E402


def _stat(pid: int) -> List[str]:
    """The fields of /proc/PID/stat after the command name (state is [0], ppid [1])."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return stat[stat.rfind(")") + 2 :].split()


def _all_pids() -> Iterator[int]:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            yield int(entry)


def child_pids(parent: int = 0) -> Set[int]:
    """Live (non-zombie and zombie) children of ``parent`` (this process by default)."""
    parent = parent or os.getpid()
    found = set()
    for pid in _all_pids():
        try:
            if int(_stat(pid)[1]) == parent:
                found.add(pid)
        except (OSError, IndexError, ValueError):
            continue
    return found


def descendants(pid: int) -> Set[int]:
    """Every process below ``pid`` (its children, theirs, ...), as ``/proc`` shows them now."""
    found: Set[int] = set()
    todo = [pid]
    while todo:
        kids = child_pids(todo.pop())
        todo.extend(kids - found)
        found |= kids
    return found


def _marked(pid: int) -> bool:
    """Whether ``pid`` was started with this session's marker in its environment."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return _MARKER_BYTES in f.read().split(b"\0")
    except OSError:
        return False


def session_pids() -> Set[int]:
    """This session's processes: this process's children (zombies included), their live
    descendants, and every live process that carries the session's marker."""
    me = os.getpid()
    parents: Dict[int, int] = {}
    states: Dict[int, str] = {}
    for pid in _all_pids():
        try:
            fields = _stat(pid)
            parents[pid], states[pid] = int(fields[1]), fields[0]
        except (OSError, IndexError, ValueError):
            continue
    ours = {pid for pid, parent in parents.items() if parent == me}
    frontier = set(ours)
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - ours
        ours |= frontier
    # Beyond our own zombies (ours to reap), only live processes count.
    ours = {p for p in ours if parents[p] == me or states[p] != "Z"}
    live_others = (p for p in parents if p not in ours and p != me and states[p] != "Z")
    ours |= {p for p in live_others if _marked(p)}
    return ours


def stray_children() -> Set[int]:
    """Live children of this process other than the session's helpers."""
    return {p for p in child_pids() if p not in _helpers() and alive(p)}


def _helpers() -> Set[int]:
    """Processes that live for the whole session: the resource tracker, the zygotes and the
    children they keep ready."""
    from multiprocessing import resource_tracker

    from tether.zygote import client

    return {getattr(resource_tracker._resource_tracker, "_pid", None), *client.pids()}


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        return _stat(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def sigint_as_at_a_terminal() -> None:
    """``preexec_fn`` of a child that a test interrupts as Ctrl-C would: SIGINT at its
    default, as under a terminal, even when this run inherited it ignored (as a background
    job of a non-interactive shell does, e.g. ``make test &`` in a script)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_gone(pids: List[int], limit: float) -> List[int]:
    """Waits up to ``limit`` seconds for every pid to be gone; returns those still alive."""
    end = time.monotonic() + limit
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < end:
        time.sleep(0.02)
        left = [p for p in left if alive(p)]
    return left


_SHM = "/dev/shm"
#: Segment names that carry their creator's pid: torch's, and this process's semaphores.
_PID_IN_NAME = re.compile(r"^(?:torch_|sem\.mp-tether)(\d+)[_-]")


def _files_held_by(pids: Iterable[int]) -> Set[Tuple[int, int]]:
    """The (device, inode) of every file that any of ``pids`` has mapped or open. (A
    semaphore is mapped under the temporary name glibc created it with, so its inode, not
    its name, tells which one it is.)"""
    held = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[4] != "0":
                        major, minor = (int(x, 16) for x in fields[3].split(":"))
                        held.add((os.makedev(major, minor), int(fields[4])))
            fd_dir = f"/proc/{pid}/fd"
            for fd in os.listdir(fd_dir):
                try:
                    st = os.stat(f"{fd_dir}/{fd}")
                except OSError:
                    continue
                held.add((st.st_dev, st.st_ino))
        except OSError:
            continue
    return held


def shm_entries(pids: Set[int]) -> Set[str]:
    """The /dev/shm entries that belong to this session (``pids`` and this process): held
    open or mapped by one of them, or named after one of them."""
    ours = pids | {os.getpid()}
    held = _files_held_by(ours)
    names, owned = set(), set()
    for entry in os.scandir(_SHM):
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        names.add(entry.name)
        if (st.st_dev, st.st_ino) in held:
            owned.add(entry.name)
    for name in names - owned:
        match = _PID_IN_NAME.match(name)
        if not match:
            continue
        pid = int(match.group(1))
        if pid in ours or (pid in _seen and not os.path.exists(f"/proc/{pid}")):
            owned.add(name)  # named after one of ours, or after one of ours gone since
    return owned


#: Every process of this session seen by a check: a name that carries the pid of one that
#: has exited since is ours; the pid of another program's process that has exited is not.
_seen: Set[int] = set()


def _own_fds() -> Set[str]:
    """This process's fds, less the pidfds by which tether watches the session's helpers
    (the zygote's ready children come and go). The helpers are read after the fds, so that
    a child registered meanwhile is among them."""
    pids = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                info = f.read()
        except OSError:
            continue
        pid = next((line.split()[1] for line in info.splitlines() if line.startswith("Pid:")), "")
        pids[fd] = int(pid) if pid.lstrip("-").isdigit() else None
    helpers = _helpers()
    return {fd for fd, pid in pids.items() if pid not in helpers}


def _snapshot() -> Dict[str, Set[str]]:
    gc.collect()
    helpers = _helpers()
    pids = session_pids() - helpers
    _seen.update(pids)
    return {
        "processes": {str(p) for p in pids},
        "fds": _own_fds(),
        "tmp": set(os.listdir(tempfile.gettempdir())),
        "shm": shm_entries(pids),
    }


@pytest.fixture
def nodes() -> Iterator[List[Any]]:
    """The launchers (``test_multinode.Node``) a multi-node test started; any still running
    at its end are killed."""
    started: List[Any] = []
    yield started
    for node in started:
        if node.proc.poll() is None:
            node.proc.kill()
        node.proc.wait()


@pytest.fixture(params=START_METHODS)
def start_method(request: pytest.FixtureRequest) -> str:
    """Each of tether's start methods in turn (their one list is ``spawn.launch.STARTERS``)."""
    return request.param


@pytest.fixture(scope="session", autouse=True)
def _long_lived_helpers() -> None:
    """Starts what lives for the whole session (the resource tracker, the warden thread)
    so that the per-test check sees only what a test itself left."""
    from multiprocessing import resource_tracker

    import tether

    resource_tracker.ensure_running()
    tether.start_processes(_noop, nprocs=1, start_method="spawn")
    # The default zygote lives as long as the process that uses it.
    tether.start_processes(_noop, nprocs=1, start_method="forkserver")
    # multiprocessing keeps the shared-memory arena of its first Value for reuse.
    _kept.append(multiprocessing.get_context("spawn").Value("i", 0))


_kept: List[object] = []


def _noop(i: int) -> None:
    pass


@pytest.fixture(scope="session", autouse=True)
def _private_tmp() -> Iterator[None]:
    yield
    import shutil

    shutil.rmtree(_PRIVATE_TMP, ignore_errors=True)


@pytest.fixture(autouse=True)
def leaves_nothing_behind() -> Iterator[None]:
    before = _snapshot()
    yield
    deadline = time.monotonic() + 5
    while True:
        after = _snapshot()
        leaked = {k: after[k] - before[k] for k in after}
        # Another test's temp files (pytest's own) are not ours to judge.
        leaked["tmp"] = {n for n in leaked["tmp"] if not n.startswith("pytest-")}
        if not any(leaked.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for fd in leaked["fds"]:
        try:
            leaked["fds"] = leaked["fds"] - {fd} | {f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}"}
        except OSError:
            pass
    leaked["processes"] = {_describe(p) for p in leaked["processes"]}
    assert not any(leaked.values()), f"left behind: {leaked}"


def cmdline(pid: "int | str") -> str:
    """A process's command line, its arguments joined by spaces ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _describe(pid: str) -> str:
    """``pid (command line)`` for a leak report."""
    command = cmdline(pid)
    return f"{pid} ({command})" if command else pid
