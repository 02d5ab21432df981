"""Stacks on demand and a bound on time: every rank's Python stack, asked without stopping
it (spawn in each start method, a pool worker, a ``tether run`` rank), the rank that cannot
answer named as such, and ``timeout`` / ``--timeout`` / ``--stall-timeout`` ending a stuck
job with every stack shown and nothing left running."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List

import pytest
import stuck

import tether
from conftest import wait_gone

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).parent / "scripts" / "stuck_rank.py"


def frame(kind: str) -> str:
    """The line of a stack that shows a thread stuck in ``stuck_here`` on ``kind``'s line."""
    return f'File "{stuck.FILE}", line {stuck.line_of(kind)} in stuck_here'


def when_stuck(ask: Callable[[], Dict[int, str]], keys: Iterable[int]) -> Dict[int, str]:
    """Asks until every stack in ``keys`` shows a thread on one of ``stuck_here``'s marked
    lines (the ranks need a moment to get there: the "lock" one first waits for its holder
    thread to start), for at most 30 s; returns the last answer."""
    keys = list(keys)
    end = time.monotonic() + 30

    def stuck_at_a_mark(text: str) -> bool:
        return any(frame(kind) in text for kind in stuck.KINDS)

    while True:
        stacks = ask()
        if all(stuck_at_a_mark(stacks.get(k, "")) for k in keys) or time.monotonic() > end:
            return stacks
        time.sleep(0.05)


def kill_all(ctx: tether.ProcessContext) -> None:
    for process in ctx.processes:
        process.kill()
    with pytest.raises(tether.ProcessExitedException):
        ctx.join()


def wait_state(pid: int, state: str) -> None:
    end = time.monotonic() + 10
    while time.monotonic() < end:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == state:
                return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} never reached state {state}")


# spawn ------------------------------------------------------------------------------------


def test_every_rank_shows_the_line_it_is_stuck_on(start_method: str, capfd) -> None:
    ctx = tether.start_processes(stuck.rank, nprocs=4, join=False, start_method=start_method)
    try:
        stacks = when_stuck(lambda: ctx.stacks(timeout=5), range(4))
        for rank, kind in enumerate(stuck.KINDS):
            assert frame(kind) in stacks[rank], stacks[rank]
        # The lock's holder is another thread of the same rank, shown too.
        assert "in hold" in stacks[2] and stacks[2].lower().count("thread 0x") == 2, stacks[2]
        # Spinning in C with the GIL held, the rank still answers: the C call's Python frame
        # (re.match) over the line that called it.
        assert "in match" in stacks[3].split(frame("regex"))[0], stacks[3]
        assert ctx.processes[0].is_alive() and ctx.processes[3].is_alive()
    finally:
        kill_all(ctx)
    # The stacks never went through the ranks' own stderr.
    assert "stuck_here" not in capfd.readouterr().err


def test_a_stopped_rank_is_named_unresponsive_and_holds_up_no_one() -> None:
    ctx = tether.start_processes(stuck.rank, nprocs=3, join=False, start_method="forkserver")
    try:
        when_stuck(lambda: ctx.stacks(timeout=5), range(3))
        stopped = ctx.pids()[1]
        os.kill(stopped, signal.SIGSTOP)
        wait_state(stopped, "T")
        started = time.monotonic()
        stacks = ctx.stacks(timeout=1.0)
        took = time.monotonic() - started
        assert 1.0 <= took < 3.0, took
        assert frame("sleep") in stacks[0] and frame("lock") in stacks[2]
        assert f"pid {stopped} did not answer within 1 s" in stacks[1], stacks[1]
        assert "stopped (state T)" in stacks[1], stacks[1]
        os.kill(stopped, signal.SIGCONT)
        # Continued, it answers again (its late dump for the first request is dropped).
        assert frame("queue") in when_stuck(lambda: ctx.stacks(timeout=5), [1])[1]
    finally:
        kill_all(ctx)


def start_and_end_threads(i: int, limit: float) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        thread = threading.Thread(target=time.sleep, args=(0,))
        thread.start()
        thread.join()


def test_asking_a_rank_that_starts_and_ends_threads_never_crashes_it() -> None:
    # faulthandler's dump from a signal handler reads the other threads without a lock,
    # which crashes a process that is starting or ending a thread at that moment; a rank
    # whose interpreter can answer answers from its main thread instead.
    ctx = tether.start_processes(
        start_and_end_threads, args=(60.0,), nprocs=2, join=False, start_method="forkserver"
    )
    try:
        for _ in range(400):
            stacks = ctx.stacks(timeout=5)
            assert all(p.is_alive() for p in ctx.processes), stacks
        assert all("in start_and_end_threads" in text for text in stacks.values()), stacks
    finally:
        kill_all(ctx)


def exit_at_once_or_sleep(i: int) -> None:
    if i == 1:
        stuck.stuck_here("sleep")


def test_a_rank_that_has_exited_says_so() -> None:
    ctx = tether.start_processes(exit_at_once_or_sleep, nprocs=2, join=False)
    try:
        ctx.processes[0].join(10)
        stacks = when_stuck(lambda: ctx.stacks(timeout=5), [1])
        pid = ctx.pids()[0]
        assert stacks[0] == f"(no Python stack: pid {pid} has exited with exit code 0)"
        assert frame("sleep") in stacks[1]
    finally:
        kill_all(ctx)


def test_timeout_shows_every_stack_then_stops_every_rank(start_method: str) -> None:
    started = time.monotonic()
    with pytest.raises(tether.ProcessTimeoutError) as info:
        tether.start_processes(stuck.rank, nprocs=2, start_method=start_method, timeout=1.5)
    took = time.monotonic() - started
    error = info.value
    assert isinstance(error, TimeoutError) and error.timeout == 1.5
    assert 1.5 <= took < 10, took
    assert sorted(error.stacks) == [0, 1]
    assert frame("sleep") in error.stacks[0] and frame("queue") in error.stacks[1]
    assert "ran past their timeout of 1.5 s" in str(error)
    assert "-- rank 1 (pid " in str(error) and frame("queue") in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), copy.stacks, copy.timeout, str(copy)) == (
        type(error),
        error.stacks,
        1.5,
        str(error),
    )


def test_timeout_with_join_false_raises_from_join_once_past() -> None:
    ctx = tether.start_processes(stuck.rank, nprocs=1, join=False, timeout=1.0)
    assert ctx.join(timeout=0.1) is False
    with pytest.raises(tether.ProcessTimeoutError) as info:
        while not ctx.join(timeout=5):
            pass
    assert frame("sleep") in info.value.stacks[0]
    assert not wait_gone(ctx.pids(), 5)
    assert ctx.join() is True


def quick(i: int) -> None:
    pass


def test_a_job_that_finishes_in_time_is_untouched_by_its_timeout(start_method: str) -> None:
    assert tether.start_processes(quick, nprocs=2, start_method=start_method, timeout=60) is None
    ctx = tether.start_processes(quick, nprocs=2, join=False, start_method=start_method, timeout=60)
    assert ctx.join(timeout=30) is True
    assert [p.exitcode for p in ctx.processes] == [0, 0]
    assert tether.spawn(quick, nprocs=1, timeout=60) is None


def test_timeouts_are_positive_numbers_of_seconds() -> None:
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            tether.start_processes(quick, nprocs=1, timeout=bad)
    with pytest.raises(TypeError, match="timeout must be a number"):
        tether.start_processes(quick, nprocs=1, timeout="10")  # type: ignore[arg-type]
    ctx = tether.start_processes(quick, nprocs=1, join=False)
    with pytest.raises(ValueError):
        ctx.stacks(timeout=0)
    assert ctx.join(timeout=30)


# native frames ----------------------------------------------------------------------------


def fake_py_spy(tmp_path: Path) -> Path:
    """A stand-in for py-spy that prints what it was asked."""
    path = tmp_path / "py-spy"
    path.write_text('#!/bin/sh\necho "native view: $*"\n')
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("named", ["a missing file", "a directory", "/bin/sh"])
def test_a_tether_py_spy_that_is_not_py_spy_is_named_for_what_it_is(
    named: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = {"a missing file": tmp_path / "gone", "a directory": tmp_path, "/bin/sh": "/bin/sh"}
    expected = {
        "a missing file": f"{tmp_path / 'gone'} does not exist)",
        "a directory": f"{tmp_path} is a directory, not py-spy)",
        "/bin/sh": "/bin/sh failed (exit status: ",
    }
    ctx = tether.start_processes(stuck.rank, nprocs=1, join=False)
    try:
        pid = ctx.pids()[0]
        when_stuck(lambda: ctx.stacks(timeout=5), [0])
        monkeypatch.setenv("TETHER_PY_SPY", str(path[named]))
        text = ctx.stacks(native=True)[0]
        native = text.split("\n\nNative stack (py-spy dump --native):\n")[1]
        assert native.startswith(f"(no native stack of pid {pid}: "), native
        assert expected[named] in native and "ptrace" not in native, native
        if named == "/bin/sh":
            assert ") without giving one: is it py-spy?)" in native, native
    finally:
        kill_all(ctx)


def test_native_frames_come_from_py_spy_and_its_absence_is_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = tether.start_processes(stuck.rank, nprocs=1, join=False)
    try:
        pid = ctx.pids()[0]
        when_stuck(lambda: ctx.stacks(timeout=5), [0])
        monkeypatch.setenv("TETHER_PY_SPY", str(fake_py_spy(tmp_path)))
        text = ctx.stacks(native=True)[0]
        python, native = text.split("\n\nNative stack (py-spy dump --native):\n")
        assert frame("sleep") in python
        assert native == f"native view: dump --native --pid {pid}"
        assert "Native stack" not in ctx.stacks()[0]
        monkeypatch.setenv("TETHER_PY_SPY", "")
        alone = ctx.stacks(native=True)[0]
        assert frame("sleep") in alone and "Native stack" not in alone
        monkeypatch.delenv("TETHER_PY_SPY")
        if tether.common.stacks.py_spy() is not None:
            # The real py-spy: native frames, or (without ptrace rights) a line saying so.
            real = ctx.stacks(native=True)[0].split("Native stack (py-spy dump --native):\n")
            assert "time_sleep" in real[1] or "needs ptrace rights" in real[1], real[1]
    finally:
        kill_all(ctx)


# the pool ---------------------------------------------------------------------------------


def test_pool_workers_show_where_they_are_stuck() -> None:
    kinds = ("sleep", "queue", "lock")
    pool = tether.Pool(3, start_method="forkserver")
    try:
        futures = [pool.submit(stuck.stuck_here, kind, 30.0) for kind in kinds]

        def ask() -> Dict[int, str]:
            return dict(enumerate(pool.stacks(timeout=5).values()))

        stacks = when_stuck(ask, range(3))
        assert sorted(pool.stacks()) == sorted(pool.pids())
        for kind in kinds:
            assert any(frame(kind) in text for text in stacks.values()), (kind, stacks)
    finally:
        for pid in pool.pids():
            os.kill(pid, signal.SIGKILL)
        for future in futures:
            assert future.exception(timeout=30) is not None
        pool.shutdown()


# tether run -------------------------------------------------------------------------------


def tether_cli(*args: str) -> List[str]:
    return [str(Path(sys.executable).with_name("tether")), *args]


class Launcher:
    """A running ``tether run``, its output read as it comes."""

    def __init__(self, *args: str, **env: str) -> None:
        self.proc = subprocess.Popen(
            tether_cli("run", *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        self.out: List[str] = []
        self.err: List[str] = []
        self.readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out)),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err)),
        ]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream, lines: List[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def wait_for(self, lines: List[str], test: Callable[[List[str]], bool]) -> None:
        end = time.monotonic() + 30
        while not test(list(lines)):
            assert self.proc.poll() is None, (self.out, self.err)
            assert time.monotonic() < end, (self.out, self.err)
            time.sleep(0.02)

    def pids(self, n: int) -> List[int]:
        """The pids the ``n`` ranks print once they run."""
        self.wait_for(self.out, lambda out: sum("ready" in line for line in out) == n)
        return [int(line.split()[-1]) for line in self.out if "ready" in line]

    def finish(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        for reader in self.readers:
            reader.join(10)
        return code


def stack_lines(err: List[str], rank: int) -> List[str]:
    return [line for line in err if line.startswith(f"[rank {rank}]: ")]


def test_tether_run_prints_every_rank_stack_on_sigusr1_and_tether_stacks(tmp_path: Path) -> None:
    run = Launcher("-n", "4", "--tee", "3", "--log-dir", str(tmp_path), str(SCRIPT))
    pids = run.pids(4)

    def shown(times: int) -> Callable[[List[str]], bool]:
        lines = [f"[rank {r}]:   {frame(k)}" for r, k in enumerate(stuck.KINDS)]
        return lambda err: all(err.count(line) == times for line in lines)

    os.kill(run.proc.pid, signal.SIGUSR1)
    run.wait_for(run.err, shown(1))
    assert any(
        line.startswith("tether: SIGUSR1 asked: the stack of every rank (4 of 4")
        for line in run.err
    ), run.err
    assert stack_lines(run.err, 3)[1].endswith(" in match"), stack_lines(run.err, 3)
    asked = subprocess.run(
        tether_cli("stacks", str(run.proc.pid)), capture_output=True, text=True, timeout=30
    )
    assert asked.returncode == 0, asked.stderr
    run.wait_for(run.err, shown(2))
    # The run went on; the ranks' own logs never saw their stacks.
    assert all(os.path.exists(f"/proc/{pid}") for pid in pids)
    logs = "".join(p.read_text() for p in tmp_path.rglob("*.log"))
    assert "ready" in logs and "stuck_here" not in logs
    run.proc.terminate()
    assert run.finish() == 128 + signal.SIGTERM
    assert not wait_gone(pids, 10)


def test_tether_stacks_refuses_a_pid_that_is_no_tether_run() -> None:
    asked = subprocess.run(
        tether_cli("stacks", str(os.getpid())), capture_output=True, text=True, timeout=30
    )
    assert asked.returncode == 1
    assert f"pid {os.getpid()} is not a running `tether run`" in asked.stderr


def test_a_rank_that_is_no_python_process_is_named(tmp_path: Path) -> None:
    script = tmp_path / "rank.sh"
    script.write_text('echo "ready $$"\nexec sleep 30\n')
    run = Launcher("-n", "1", "--no-python", "sh", str(script))
    (pid,) = run.pids(1)
    os.kill(run.proc.pid, signal.SIGUSR1)
    run.wait_for(run.err, lambda err: bool(stack_lines(err, 0)))
    assert stack_lines(run.err, 0) == [
        f"[rank 0]: (no Python stack: pid {pid} cannot answer: it is not a Python process "
        "started by tether's Python, or it is still starting up)"
    ]
    assert os.path.exists(f"/proc/{pid}")
    run.proc.terminate()
    assert run.finish() == 128 + signal.SIGTERM


@pytest.mark.parametrize(
    "limit, said",
    [
        (["--timeout", "3"], "the run reached its --timeout of 3 s"),
        (["--stall-timeout", "2"], "no rank printed anything for 2 s (--stall-timeout)"),
    ],
)
def test_tether_run_past_a_limit_shows_the_stacks_stops_and_exits_124(
    limit: List[str], said: str
) -> None:
    run = Launcher("-n", "2", "--grace-period", "2", *limit, str(SCRIPT), TETHER_PY_SPY="")
    pids = run.pids(2)
    assert run.finish() == 124
    assert f"tether: {said}: the stack of every rank (2 of 2 answered" in "\n".join(run.err)
    assert f"[rank 0]:   {frame('sleep')}" in run.err
    assert f"[rank 1]:   {frame('queue')}" in run.err
    assert not any("Native stack" in line for line in run.err)
    # Two ranks in two places: the summary says no place holds most of them.
    at = f"stuck.py:{stuck.line_of('sleep')} in stuck_here"
    waits = f"get called from stuck.py:{stuck.line_of('queue')}"
    summary = f"rank 0 is at {at}; rank 1 waits in {waits}"
    assert f"tether: summary: no place holds most of the ranks; {summary}" in run.err
    assert run.err[-1] == f"tether: every rank was stopped: {said}; exit status 124"
    assert not wait_gone(pids, 10)


def test_tether_run_timeout_adds_py_spy_native_frames(tmp_path: Path) -> None:
    py_spy = str(fake_py_spy(tmp_path))
    run = Launcher("-n", "1", "--timeout", "2", str(SCRIPT), TETHER_PY_SPY=py_spy)
    (pid,) = run.pids(1)
    assert run.finish() == 124
    assert "[rank 0]: Native stack (py-spy dump --native):" in run.err
    assert f"[rank 0]: native view: dump --native --pid {pid}" in run.err


def test_tether_run_that_finishes_in_time_is_untouched(tmp_path: Path) -> None:
    script = tmp_path / "quick.py"
    script.write_text("print('done')\n")
    proc = subprocess.run(
        tether_cli("run", "-n", "2", "--timeout", "60", "--stall-timeout", "60", str(script)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[rank 0]: done", "[rank 1]: done"]
    assert proc.stderr == ""
