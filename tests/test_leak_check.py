"""The per-test leak check (conftest.py) sees what this session leaves and nothing else: a
process, semaphore or temp file of another program on the machine is not ours, while our
own (even an orphan in a new session) is."""

from __future__ import annotations

import _multiprocessing
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import conftest
from conftest import MARKER_VAR, wait_gone

# A daemon in its own session, whose parent has exited: it is nobody's child any more. It
# makes a named semaphore as multiprocessing does, prints its pid, and waits.
_DAEMON = textwrap.dedent(
    """
    import _multiprocessing, os, sys, time
    if os.fork():
        os._exit(0)
    os.setsid()
    lock = _multiprocessing.SemLock(1, 1, 1, sys.argv[1], False)
    print(os.getpid(), flush=True)
    os.close(1)
    time.sleep(60)
    """
)


def _start_daemon(env):
    """(pid, semaphore file name) of a new daemon started with ``env``."""
    name = f"/mp-leak-check-{os.getpid()}-{len(env)}"
    out = subprocess.run(
        [sys.executable, "-c", _DAEMON, name],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        timeout=30,
    ).stdout
    return int(out), "sem." + name[1:]


def _stop(pid, sem):
    os.kill(pid, signal.SIGKILL)
    os.unlink(f"/dev/shm/{sem}")
    assert wait_gone([pid], 5.0) == []


def test_an_orphan_of_ours_and_its_semaphore_are_seen():
    pid, sem = _start_daemon(dict(os.environ))
    try:
        ours = conftest.session_pids()
        assert pid in ours
        assert sem in conftest.shm_entries(ours)
    finally:
        _stop(pid, sem)
    assert pid not in conftest.session_pids()


def test_another_programs_process_and_semaphore_are_not_ours():
    env = {k: v for k, v in os.environ.items() if k != MARKER_VAR}
    pid, sem = _start_daemon(env)
    try:
        assert sem in os.listdir("/dev/shm")
        ours = conftest.session_pids()
        assert pid not in ours
        assert sem not in conftest.shm_entries(ours)
    finally:
        _stop(pid, sem)


def test_a_semaphore_named_as_ours_by_another_session_whose_process_ended_is_not_ours():
    # Another `make test` names its semaphores after its own pid; when that process ends
    # while ours runs a test, its leftover name must not become our leak. (A process that
    # has ended stands for it; that its semaphore comes from here changes nothing, since
    # nothing here holds it open.)
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        stdout=subprocess.PIPE,
        text=True,
        timeout=30,
    )
    name = f"/mp-tether{int(ended.stdout)}-neighbour"
    _multiprocessing.SemLock(1, 1, 1, name, False)  # closed at once, left in /dev/shm
    sem = "sem." + name[1:]
    try:
        assert sem in os.listdir("/dev/shm")
        assert sem not in conftest.shm_entries(conftest.session_pids())
    finally:
        os.unlink(f"/dev/shm/{sem}")


def test_our_own_semaphores_and_children_are_seen():
    lock = multiprocessing.get_context("spawn").Lock()
    name = "sem." + lock._semlock.name.lstrip("/")
    assert name.startswith(f"sem.mp-tether{os.getpid()}-")
    assert name in conftest.shm_entries(conftest.session_pids())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert child.pid in conftest.session_pids()
    finally:
        child.kill()
        child.wait()
    del lock
    assert name not in conftest.shm_entries(conftest.session_pids())


def test_a_file_in_the_private_temp_dir_is_seen():
    before = conftest._snapshot()
    fd, path = tempfile.mkstemp()
    high = os.dup2(fd, 999)
    try:
        after = conftest._snapshot()
        assert after["tmp"] - before["tmp"] == {os.path.basename(path)}
        assert "999" in after["fds"] - before["fds"]
    finally:
        os.close(high)
        os.close(fd)
        os.unlink(path)
