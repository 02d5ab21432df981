"""``tether top PID`` on a real running ``tether run``: ``--once`` and ``--json`` give one row
per rank whose pid, state and resident memory agree with ``ps``, each rank's place in its
code (where its stack is) and for how long, and the processes the rank started (as
DataLoader workers are) with their CPU; the job's own stderr shows none of it."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest

from conftest import child_pids, descendants, wait_gone

pytestmark = pytest.mark.timeout(120)

BIN = Path(sys.executable).with_name("tether")

#: Rank 0 spins in `spin`, with one forked child spinning too (a worker); rank 1 sleeps in
#: `nap`. Each says when it is in place.
JOB = r"""
import multiprocessing as mp, os, sys, time

def spin():
    while True:
        pass

def nap():
    while True:
        time.sleep(1)

if os.environ["RANK"] == "0":
    worker = mp.get_context("fork").Process(target=spin, daemon=True)
    worker.start()
    print("in place", flush=True)
    spin()
else:
    print("in place", flush=True)
    nap()
"""


@pytest.fixture
def job(tmp_path: Path) -> Any:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    err = tmp_path / "job.err"
    with open(tmp_path / "job.out", "w") as out, open(err, "w") as errf:
        proc = subprocess.Popen(
            [str(BIN), "run", "-n", "2", "--no-warm", str(script)],
            stdout=out,
            stderr=errf,
            stdin=subprocess.DEVNULL,
            cwd=tmp_path,
        )
    deadline = time.monotonic() + 60
    while (tmp_path / "job.out").read_text().count("in place") < 2:
        assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
        time.sleep(0.1)
    try:
        yield proc, err
    finally:
        everything = sorted(descendants(proc.pid))
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert wait_gone(everything, 10) == []


def ps(pid: int) -> Dict[str, str]:
    out = subprocess.run(
        ["ps", "-o", "stat=,rss=", "-p", str(pid)], capture_output=True, text=True, check=True
    ).stdout.split()
    return {"state": out[0][0], "rss": out[1]}


def top(pid: int, *flags: str) -> str:
    done = subprocess.run(
        [str(BIN), "top", str(pid), *flags], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def differences(rows: List[Dict[str, Any]]) -> List[Any]:
    """How each row differs from what ``ps`` says of its pid now (none: they agree)."""
    found = []
    for row in rows:
        seen = ps(row["pid"])
        kib = int(seen["rss"])
        if row["state"] != seen["state"] or abs(row["rss"] / 1024 - kib) > max(2048, kib * 0.1):
            found.append((row, seen))
    return found


def check_against_ps(rows: List[Dict[str, Any]], again: Callable[[], List[Dict[str, Any]]]) -> None:
    """The rows agree with ``ps``: a rank that naps is running for a moment now and then,
    so a row and ``ps`` may catch it apart; they must agree on one of a few fresh reads."""
    for _ in range(5):
        found = differences(rows)
        if not found:
            return
        rows = again()
    assert not found, found


def test_json_gives_each_ranks_pid_state_memory_place_and_workers_as_ps_sees_them(
    job: Any,
) -> None:
    proc, err = job
    rows = json.loads(top(proc.pid, "--json"))
    check_against_ps(rows, lambda: json.loads(top(proc.pid, "--json")))
    assert [row["rank"] for row in rows] == [0, 1], rows
    for row in rows:
        assert set(row) >= {"rank", "pid", "state", "cpu", "rss", "place", "seconds", "workers"}
    ranks = sorted(child_pids(next(iter(child_pids(proc.pid)))))
    assert sorted(row["pid"] for row in rows) == ranks
    spinner, napper = rows
    assert spinner["place"].endswith("in spin") and napper["place"].endswith("in nap"), rows
    assert spinner["state"] == "R" and napper["state"] == "S", rows
    assert spinner["cpu"] > 10 and napper["cpu"] < 10, rows
    [worker] = spinner["workers"]
    assert worker["pid"] in child_pids(spinner["pid"]) and worker["cpu"] > 10, worker
    assert napper["workers"] == []
    # The launcher remembers when it first saw each rank in its place.
    time.sleep(1)
    again = json.loads(top(proc.pid, "--json"))
    assert again[1]["seconds"] >= rows[1]["seconds"] + 1, (rows, again)
    # Quiet: the job's stderr shows no block of stacks.
    assert "the stack of every rank" not in err.read_text()


def test_once_prints_one_table_with_a_row_per_rank(job: Any) -> None:
    proc, _ = job
    text = top(proc.pid, "--once")
    rows = table(text)
    assert [r["rank"] for r in rows] == [0, 1], text
    check_against_ps(rows, lambda: table(top(proc.pid, "--once")))
    assert "workers:" in text, text


def table(text: str) -> List[Dict[str, Any]]:
    """The rows of ``--once``'s table."""
    row = re.compile(r"^\s+(\d+)\s+(\d+) (\S)\s+([\d.]+)\s+([\d.]+)M\s+([\d.]+)  (.+)$", re.M)
    return [
        {"rank": int(r), "pid": int(p), "state": s, "rss": float(m) * 1024 * 1024, "place": w}
        for r, p, s, _, m, _, w in row.findall(text)
    ]


def test_a_pid_that_is_no_tether_run_is_named() -> None:
    done = subprocess.run([str(BIN), "top", "1", "--once"], capture_output=True, text=True)
    assert done.returncode == 1 and "not a running `tether run`" in done.stderr
    done = subprocess.run([str(BIN), "top"], capture_output=True, text=True)
    assert done.returncode == 2 and "usage: tether top PID" in done.stdout


#: The same ranks from ``tether.spawn`` (``join=False``); the parent also forks a helper of
#: its own, which is no job: it inherited nothing that answers ``tether top``.
SPAWN_JOB = r"""
import multiprocessing as mp, os, sys, time
import tether

def spin():
    parent = os.getppid()
    while os.getppid() == parent:
        pass

def nap():
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.2)

def rank(i):
    if i == 0:
        worker = mp.get_context("fork").Process(target=spin, daemon=True)
        worker.start()
        spin()
    nap()

if __name__ == "__main__":
    ctx = tether.start_processes(rank, nprocs=2, join=False)
    helper = mp.get_context("fork").Process(target=nap, daemon=True)
    helper.start()
    print("ranks", *ctx.pids(), "helper", helper.pid, flush=True)
    ctx.join()
"""


@pytest.fixture
def spawn_job(tmp_path: Path) -> Any:
    script = tmp_path / "job.py"
    script.write_text(SPAWN_JOB)
    out = tmp_path / "job.out"
    with open(out, "w") as outf, open(tmp_path / "job.err", "w") as errf:
        proc = subprocess.Popen(
            [sys.executable, str(script)], stdout=outf, stderr=errf, stdin=subprocess.DEVNULL
        )
    deadline = time.monotonic() + 60
    while "helper" not in out.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
        time.sleep(0.1)
    words = out.read_text().split()
    ranks, helper = [int(w) for w in words[1:3]], int(words[4])
    try:
        yield proc, ranks, helper
    finally:
        everything = sorted(descendants(proc.pid) | set(ranks))
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert wait_gone(everything, 10) == []


def test_a_spawn_job_is_shown_from_the_process_that_called_spawn(spawn_job: Any) -> None:
    proc, ranks, helper = spawn_job
    rows = json.loads(top(proc.pid, "--json"))
    assert [(row["rank"], row["pid"]) for row in rows] == [(0, ranks[0]), (1, ranks[1])], rows
    check_against_ps(rows, lambda: json.loads(top(proc.pid, "--json")))
    spinner, napper = rows
    assert spinner["place"].endswith("in spin"), rows
    assert napper["place"].endswith("in nap"), rows
    assert spinner["cpu"] > 10 and napper["cpu"] < 10, rows
    [worker] = spinner["workers"]
    assert worker["pid"] in child_pids(spinner["pid"]) and worker["cpu"] > 10, worker
    time.sleep(1)
    again = json.loads(top(proc.pid, "--json"))
    assert again[1]["seconds"] >= rows[1]["seconds"] + 1, (rows, again)
    text = top(proc.pid, "--once")
    assert text.startswith(f"tether top: `tether.spawn` job pid {proc.pid}, 2 rank(s)"), text
    # A child forked from the parent is no job of its own.
    done = subprocess.run([str(BIN), "top", str(helper), "--once"], capture_output=True, text=True)
    assert done.returncode == 1 and "not a running `tether run`" in done.stderr, done.stderr
