"""Ranks that do what a user's program may do to tether's stacks channel and signals, for
the tests that check a stacks request never touches the program (test_stacks_safety.py and
the ``tether run`` script scripts/adversary_rank.py).

Every rank here runs until a file named ``stop`` appears in its directory (at most
``LIMIT`` seconds), says it is ready by creating ``ready.<rank>`` there, and exits with 0 when
nothing it owns was touched, or with a code that says what was: ``BYTES`` (a byte arrived in
one of its own fds), ``FLOW`` (its control flow changed: a wait ended early, a handler of its
own ran, a result came out wrong)."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, List

LIMIT = 120.0
BYTES = 3
FLOW = 4

#: The request and dump signals (``SIGRTMIN+4``, ``SIGRTMIN+5``).
REQUEST = signal.SIGRTMIN + 4
DUMP = signal.SIGRTMIN + 5

_PBKDF2 = hashlib.pbkdf2_hmac("sha256", b"password", b"salt", 20_000)


def ready(where: str, rank: int) -> None:
    Path(where, f"ready.{rank}").touch()


def stopped(where: str) -> bool:
    return os.path.exists(os.path.join(where, "stop"))


def run_until_stopped(where: str, step: Callable[[], bool]) -> bool:
    """Calls ``step`` until ``stop`` appears; False as soon as one step says the program's
    control flow changed."""
    end = time.monotonic() + LIMIT
    while not stopped(where) and time.monotonic() < end:
        if not step():
            return False
    return True


def own_datagram_pair() -> List[socket.socket]:
    """A datagram socket pair of the program's own; the first end never blocks."""
    pair = list(socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM))
    pair[0].setblocking(False)
    return pair


def received(sock: socket.socket) -> bool:
    try:
        return bool(sock.recv(1 << 16)) or True
    except BlockingIOError:
        return False


def socket_fds() -> List[int]:
    """The socket fds above 2 this process holds."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if fd > 2 and link.startswith("socket:"):
            found.append(fd)
    return found


def busy_in_c() -> bool:
    """Some C work without the GIL, then a short sleep: both ways of answering are taken."""
    if hashlib.pbkdf2_hmac("sha256", b"password", b"salt", 20_000) != _PBKDF2:
        return False
    started = time.monotonic()
    time.sleep(0.005)
    return time.monotonic() - started >= 0.005


def reuse_channel(rank: int, where: str, kind: str) -> None:
    """A rank that puts something of its own under the number of every socket fd it holds
    (tether's stacks channel among them): its own datagram socket (``kind`` "socket") or a
    file of its own (``kind`` "file"), then works; fails if a byte arrives in either."""
    reader, writer = own_datagram_pair()
    path = os.path.join(where, f"own.{rank}")
    with open(path, "wb") as own_file:
        for fd in socket_fds():
            if fd not in (reader.fileno(), writer.fileno()):
                os.dup2(writer.fileno() if kind == "socket" else own_file.fileno(), fd)
        ready(where, rank)
        flow = run_until_stopped(where, busy_in_c)
    touched = received(reader) or os.path.getsize(path) > 0
    sys.exit(BYTES if touched else 0 if flow else FLOW)


# the kinds of rank the stress test asks a thousand times -----------------------------------


def idle(where: str) -> Callable[[], bool]:
    def step() -> bool:
        started = time.monotonic()
        time.sleep(0.05)
        return time.monotonic() - started >= 0.05

    return step


def c_without_gil(where: str) -> Callable[[], bool]:
    def step() -> bool:
        return hashlib.pbkdf2_hmac("sha256", b"password", b"salt", 20_000) == _PBKDF2

    return step


def c_with_gil(where: str) -> Callable[[], bool]:
    pattern = re.compile(r"(a+)+$")
    text = "a" * 18 + "b"

    def step() -> bool:
        return pattern.match(text) is None

    return step


def thread_churn(where: str) -> Callable[[], bool]:
    """The main thread in C without the GIL while another thread starts and ends threads:
    the case where reading other threads from a signal handler crashes."""
    done = threading.Event()

    def churn() -> None:
        while not done.is_set() and not stopped(where):
            thread = threading.Thread(target=time.sleep, args=(0,))
            thread.start()
            thread.join()

    threading.Thread(target=churn, daemon=True).start()
    return c_without_gil(where)


def in_pause(where: str) -> Callable[[], bool]:
    """``signal.pause()``, which only the parent's SIGUSR1 (sent once, after ``stop``)
    may end."""
    woken: List[int] = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: woken.append(signum))

    def step() -> bool:
        signal.pause()
        # The one wake-up allowed is SIGUSR1, and ``stop`` exists by then.
        return woken == [signal.SIGUSR1] and stopped(where)

    return step


KINDS = {
    "idle": idle,
    "c_without_gil": c_without_gil,
    "c_with_gil": c_with_gil,
    "thread_churn": thread_churn,
    "in_pause": in_pause,
}


#: The kinds whose rank also has a wakeup fd (``signal.set_wakeup_fd``), which Python's own
#: handler of a signal writes to: tether must answer those without it.
WAKEUP = ("c_with_gil", "in_pause")


def stressed(rank: int, where: str, kinds: List[str]) -> None:
    """Rank ``rank`` runs kind ``kinds[rank]`` until stopped, with a datagram socket pair,
    a pipe (and for some kinds a wakeup fd) of its own; fails if a byte arrives in one of
    them or if its control flow changed."""
    reader, writer = own_datagram_pair()
    pipe_r, pipe_w = os.pipe()
    os.set_blocking(pipe_r, False)
    wake_r, wake_w = own_datagram_pair()
    wake_w.setblocking(False)
    if kinds[rank] in WAKEUP:
        signal.set_wakeup_fd(wake_w.fileno())
    step = KINDS[kinds[rank]](where)
    ready(where, rank)
    flow = run_until_stopped(where, step)
    signal.set_wakeup_fd(-1)
    try:
        touched = bool(os.read(pipe_r, 1 << 16))
    except BlockingIOError:
        touched = False
    # SIGUSR1 (the pause rank's own) is the one byte its wakeup fd may get.
    wakeups = b""
    while True:
        try:
            wakeups += wake_r.recv(1 << 16)
        except BlockingIOError:
            break
    touched = touched or received(reader) or wakeups.replace(bytes([signal.SIGUSR1]), b"") != b""
    sys.exit(BYTES if touched else 0 if flow else FLOW)


# a program's own handlers ------------------------------------------------------------------


def own_handlers(rank: int, where: str, how: str) -> None:
    """A rank that takes tether's signals for itself: ``how`` is "signal" (its own Python
    handler for the request signal), "faulthandler" (its own dump of the dump signal, into a
    file of its own) or "sigwait" (it blocks the request signal and waits for it). Fails if
    its handler or wait ever sees one of them."""
    seen: List[int] = []
    path = os.path.join(where, f"own.{rank}")
    with open(path, "wb") as own_file:
        if how == "signal":
            signal.signal(REQUEST, lambda signum, frame: seen.append(signum))
            step = idle(where)
        elif how == "faulthandler":
            import faulthandler

            faulthandler.register(DUMP, file=own_file, all_threads=False)
            step = c_without_gil(where)
        else:
            signal.pthread_sigmask(signal.SIG_BLOCK, {REQUEST})

            def step() -> bool:
                got = signal.sigtimedwait({REQUEST}, 0.05)
                if got is not None:
                    seen.append(got.si_signo)
                return True

        ready(where, rank)
        flow = run_until_stopped(where, step)
    touched = bool(seen) or os.path.getsize(path) > 0
    sys.exit(FLOW if touched or not flow else 0)
