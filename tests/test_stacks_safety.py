"""A stacks request never touches what the program owns: it writes into no fd but the
channel the rank registered (a rank that closed or reused it is named as such, its fds
untouched), never crashes a rank, never ends its waits or calls its handlers, and a stray
``TETHER_STACKS_FD`` installs nothing (see ``tests/adversary.py`` for the ranks)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

import adversary
import pytest

import tether
from tether import _native
from tether.common import stacks

pytestmark = pytest.mark.timeout(240)

SCRIPT = Path(__file__).parent / "scripts" / "adversary_rank.py"


def wait_ready(where: Path, n: int, ctx: tether.ProcessContext) -> None:
    end = time.monotonic() + 60
    while not all((where / f"ready.{i}").exists() for i in range(n)):
        assert time.monotonic() < end, "the ranks never became ready"
        assert ctx.join(timeout=0.02) is False, "a rank ended before it was ready"


def ask(ctx: tether.ProcessContext, times: int, limit: float) -> List[Dict[int, str]]:
    """Asks every rank ``times`` times (each one dumped from a signal handler when it has
    not begun answering from its interpreter within 2 ms), within ``limit`` seconds;
    returns every answer."""
    targets = [_native.Member(ctx._group, i) for i in range(len(ctx.processes))]
    end = time.monotonic() + limit
    answers = []
    for _ in range(times):
        assert time.monotonic() < end, f"only {len(answers)} requests within {limit} s"
        got = stacks.ask(targets, 5, native=False, dump_after=0.002)
        answers.append({rank: answer.text for rank, answer in enumerate(got)})
        assert all(p.is_alive() for p in ctx.processes), answers[-1]
    return answers


def finish(ctx: tether.ProcessContext, where: Path, wake: Sequence[int] = ()) -> List[int]:
    """Lets every rank end (SIGUSR1 ends the ``signal.pause()`` of the ranks in ``wake``);
    their exit codes."""
    (where / "stop").touch()
    for rank in wake:
        try:
            os.kill(ctx.processes[rank].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    try:
        ctx.join(timeout=60)
    except tether.ProcessExitedException:
        pass
    return [p.exitcode for p in ctx.processes]


# the channel -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["socket", "file"])
def test_a_rank_that_reused_its_channel_fd_gets_no_byte_and_is_named(
    start_method: str, kind: str, tmp_path: Path
) -> None:
    ctx = tether.start_processes(
        adversary.reuse_channel,
        args=(str(tmp_path), kind),
        nprocs=2,
        join=False,
        start_method=start_method,
    )
    try:
        wait_ready(tmp_path, 2, ctx)
        answers = ask(ctx, 40, 60)
        for rank, pid in enumerate(ctx.pids()):
            assert answers[-1][rank] == (
                f"(no Python stack: pid {pid} closed its stacks channel or reused its fd "
                "number; tether writes into no fd it does not own, so this process cannot "
                "answer)"
            )
    finally:
        codes = finish(ctx, tmp_path)
    assert codes == [0, 0], "a byte of a stack arrived in a rank's own socket or file"


@pytest.mark.parametrize("kind", ["socket", "file"])
def test_a_tether_run_rank_that_reused_its_channel_fd_gets_no_byte(
    kind: str, tmp_path: Path
) -> None:
    tether_cli = str(Path(sys.executable).with_name("tether"))
    proc = subprocess.Popen(
        [tether_cli, "run", "-n", "2", str(SCRIPT), str(tmp_path), kind],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        end = time.monotonic() + 60
        while not all((tmp_path / f"ready.{i}").exists() for i in range(2)):
            assert proc.poll() is None and time.monotonic() < end
            time.sleep(0.02)
        for _ in range(5):
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(0.3)
    finally:
        (tmp_path / "stop").touch()
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    said = [line for line in err.splitlines() if "closed its stacks channel" in line]
    assert len(said) >= 2 and all(line.startswith("[rank ") for line in said), err


def test_a_stray_stacks_fd_variable_installs_nothing_and_changes_no_fd() -> None:
    # A program's own datagram socket, named by TETHER_STACKS_FD as a bare number and as a
    # number with some other socket's inode: the interpreter installs no handler, and the
    # fd stays open, inheritable and the same socket.
    check = (
        "import os, signal, sys; fd, ino = int(sys.argv[1]), int(sys.argv[2]); "
        "assert signal.getsignal(signal.SIGRTMIN + 4) == signal.SIG_DFL; "
        "assert signal.getsignal(signal.SIGRTMIN + 5) == signal.SIG_DFL; "
        "assert os.get_inheritable(fd) and os.fstat(fd).st_ino == ino; print('untouched')"
    )
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with ours, theirs:
        fd = theirs.fileno()
        inode = os.fstat(fd).st_ino
        for value in (str(fd), f"{fd}:{os.fstat(ours.fileno()).st_ino}", f"{fd}:x", "x"):
            got = subprocess.run(
                [sys.executable, "-c", check, str(fd), str(inode)],
                pass_fds=[fd],
                env={**os.environ, "TETHER_STACKS_FD": value},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert got.stdout == "untouched\n", (value, got.stderr)


# a thousand requests to each kind of rank ---------------------------------------------------


@pytest.mark.slow  # a thousand stacks requests to every kind of rank
@pytest.mark.timeout(600)
def test_a_thousand_requests_change_nothing_in_any_kind_of_rank(
    start_method: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    kinds = list(adversary.KINDS)
    ctx = tether.start_processes(
        adversary.stressed,
        args=(str(tmp_path), kinds),
        nprocs=len(kinds),
        join=False,
        start_method=start_method,
    )
    try:
        wait_ready(tmp_path, len(kinds), ctx)
        answers = ask(ctx, 1000, 400)
    finally:
        codes = finish(ctx, tmp_path, wake=[kinds.index("in_pause")])
    assert codes == [0] * len(kinds), dict(zip(kinds, codes))
    by_kind = {kind: [answer[i] for answer in answers] for i, kind in enumerate(kinds)}
    # Every rank answered every time, as it can: from its interpreter (every thread), or
    # with its main thread alone from a signal handler; the paused one was not asked.
    for kind in ("idle", "c_without_gil", "c_with_gil", "thread_churn"):
        missed = [text for text in by_kind[kind] if "in run_until_stopped" not in text]
        assert not missed, (kind, len(missed), missed[0])
    from_handler = {k: sum("only the thread" in t for t in by_kind[k]) for k in by_kind}
    assert from_handler["idle"] < 1000 and from_handler["c_with_gil"] > 0, from_handler
    assert from_handler["c_without_gil"] > 0 and from_handler["thread_churn"] > 0, from_handler
    assert all("waits in signal.pause()" in t for t in by_kind["in_pause"]), by_kind["in_pause"]
    # Nothing of a dump went through the ranks' own stdout or stderr.
    captured = capfd.readouterr()
    assert "run_until_stopped" not in captured.out + captured.err


# the program's own handlers ----------------------------------------------------------------


@pytest.mark.parametrize("how", ["signal", "faulthandler", "sigwait"])
def test_a_rank_that_takes_the_stack_signals_for_itself_is_never_sent_them(
    start_method: str, how: str, tmp_path: Path
) -> None:
    ctx = tether.start_processes(
        adversary.own_handlers,
        args=(str(tmp_path), how),
        nprocs=1,
        join=False,
        start_method=start_method,
    )
    try:
        wait_ready(tmp_path, 1, ctx)
        answers = ask(ctx, 50, 60)
    finally:
        codes = finish(ctx, tmp_path)
    assert codes == [0], answers[-1]
    pid = ctx.pids()[0]
    said = {
        "signal": "installed its own handler for tether's stack signals",
        "faulthandler": "installed its own handler for tether's stack signals",
        "sigwait": "blocks or waits for tether's stack signal (SIGRTMIN+4) in its main thread",
    }[how]
    assert answers[-1][0].startswith(f"(no Python stack: pid {pid} {said}"), answers[-1]
