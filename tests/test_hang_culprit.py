"""The summary that ends every block of stacks names the rank that is not where the others
wait: a three-rank gloo job on CPU (``culprit.py``) where ranks 0 and 1 wait in
``dist.all_reduce`` and rank 2 naps, asked through ``tether stacks PID`` (the block on its
stdout, its exit status saying whether every rank answered), SIGUSR1, ``--stall-timeout``
and ``ProcessContext.stacks()``; one launcher serves the ``tether run`` cases. The limits'
summary without a majority is in ``test_stacks.py``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, List, TypeVar

import culprit
import pytest
from test_stacks import Launcher, kill_all, tether_cli, wait_state

import tether
from conftest import wait_gone

pytestmark = pytest.mark.timeout(240)

SCRIPT = str(Path(culprit.FILE))
ALL_REDUCE = f"all_reduce called from culprit.py:{culprit.line_of('all_reduce')}"
NAP = f"culprit.py:{culprit.line_of('nap')} in nap"
#: Where the ranks are, once all of them are in place.
IN_PLACE = f"ranks 0-1 wait in {ALL_REDUCE}; rank 2 is elsewhere: {NAP}"

T = TypeVar("T")


def until(ask: Callable[[], T], done: Callable[[T], bool], limit: float = 90) -> T:
    """Asks until ``done`` holds (the ranks take a while to import torch and meet), for at
    most ``limit`` seconds; returns the last answer."""
    end = time.monotonic() + limit
    while True:
        got = ask()
        if done(got) or time.monotonic() > end:
            return got
        time.sleep(0.2)


def summaries(lines: List[str]) -> List[str]:
    return [line for line in lines if line.startswith("tether: summary: ")]


def tether_stacks(pid: int) -> "subprocess.CompletedProcess[str]":
    return subprocess.run(
        tether_cli("stacks", str(pid)), capture_output=True, text=True, timeout=60
    )


def rank_pids(out: List[str]) -> Dict[int, int]:
    """``{rank: pid}`` from the ranks' ``ready RANK PID`` lines."""
    pairs = (line.split("ready ", 1)[1].split() for line in out if "ready " in line)
    return {int(rank): int(pid) for rank, pid in pairs}


def test_tether_stacks_signals_and_limits_name_the_rank_that_is_not_in_the_collective(
    tmp_path: Path,
) -> None:
    quiet = tmp_path / "quiet"
    run = Launcher(
        "-n", "3", "--no-warm", "--stall-timeout", "5", "--grace-period", "2", SCRIPT,
        CULPRIT_QUIET=str(quiet), TETHER_PY_SPY="",
    )  # fmt: skip
    try:
        run.wait_for(run.out, lambda out: len(rank_pids(out)) == 3)
        pids = rank_pids(run.out)
        # `tether stacks PID`: the block on its stdout, the summary last; exit status 0.
        asked = until(lambda: tether_stacks(run.proc.pid), lambda a: IN_PLACE in a.stdout)
        lines = asked.stdout.splitlines()
        assert (asked.returncode, asked.stderr) == (0, ""), asked
        assert lines[0].startswith("tether: `tether stacks` asked: the stack of every rank (3 of 3")
        assert lines[-1] == f"tether: summary: {IN_PLACE}", lines
        assert any(line.startswith("[rank 2]: ") and "in nap" in line for line in lines)
        # The job's stderr shows the same block.
        run.wait_for(run.err, lambda err: f"tether: summary: {IN_PLACE}" in err)
        # SIGUSR1 to the launcher: the same summary on its stderr.
        before = len(summaries(run.err))
        os.kill(run.proc.pid, signal.SIGUSR1)
        run.wait_for(run.err, lambda err: len(summaries(err)) > before)
        assert any(line.startswith("tether: SIGUSR1 asked: the stack") for line in run.err)
        assert summaries(run.err)[before:] == [f"tether: summary: {IN_PLACE}"]
        # A stopped rank cannot answer: named with its pid, exit status 3, and with one of
        # the two collective ranks out, no place holds most of the ranks.
        os.kill(pids[1], signal.SIGSTOP)
        try:
            wait_state(pids[1], "T")
            stopped = tether_stacks(run.proc.pid)
        finally:
            os.kill(pids[1], signal.SIGCONT)
        assert stopped.returncode == 3, stopped
        assert stopped.stderr == (
            f"tether stacks: 1 of the ranks did not answer: rank 1 (pid {pids[1]}); their "
            "lines above say why\n"
        )
        assert stopped.stdout.splitlines()[-1] == (
            f"tether: summary: no place holds most of the ranks; rank 0 waits in {ALL_REDUCE}; "
            f"rank 2 is at {NAP}; rank 1 did not answer (pid {pids[1]})"
        )
        # Past --stall-timeout (rank 2 stops ticking): the same summary, then the end.
        quiet.touch()
        assert run.finish() == 124
        limit = "tether: no rank printed anything for 5 s (--stall-timeout): the stack"
        assert any(line.startswith(limit) for line in run.err), run.err
        assert summaries(run.err)[-1] == f"tether: summary: {IN_PLACE}"
        assert not wait_gone(list(pids.values()), 10)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.finish()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_process_context_stacks_carry_the_summary() -> None:
    ctx = tether.start_processes(culprit.spawned, args=(free_port(),), nprocs=3, join=False)
    try:
        stacks = until(lambda: ctx.stacks(timeout=5), lambda s: s.summary == IN_PLACE)
        assert stacks.summary == IN_PLACE
        assert sorted(stacks) == [0, 1, 2] and "in nap" in stacks[2]
        assert str(stacks).endswith(f"\n\nsummary: {IN_PLACE}")
        assert f"-- rank 2 (pid {ctx.pids()[2]}):\n" in str(stacks)
    finally:
        kill_all(ctx)
