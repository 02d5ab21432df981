"""``tether.share(build, key=...)``: the ranks of one job on a machine map one copy, built
once, under ``tether run`` and ``tether.spawn``; a build that raises raises the same error
in every rank; a builder that dies never leaves the others waiting; a rank that asks after
the builder has exited still maps the copy; ranks of other jobs never meet these; nothing is
left behind (the meeting point is gone with the job)."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import share_helpers as helpers

import tether

pytestmark = pytest.mark.timeout(120)

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "share_key.py")
LINE = re.compile(r"rank=(-?\d+) pid=(\d+) inode=(\d+) len=(\d+) name=(\S+)")


def tether_run(*args: str, ranks: int = 3) -> subprocess.CompletedProcess:
    launcher = str(Path(sys.executable).with_name("tether"))
    argv = [launcher, "run", "--nproc-per-node", str(ranks), SCRIPT, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=100, check=False)


def reports(out: str) -> Dict[int, Dict[str, str]]:
    """rank -> what it printed (pid, inode, len, name)."""
    found = {}
    for match in LINE.finditer(out):
        rank, pid, inode, length, name = match.groups()
        found[int(rank)] = {"pid": pid, "inode": inode, "len": length, "name": name}
    return found


def builds(log: Path) -> List[str]:
    return log.read_text().splitlines() if log.exists() else []


def meeting_points() -> set:
    """The abstract socket names of the meeting points alive on this machine."""
    with open("/proc/net/unix") as f:
        return {line.split()[-1] for line in f if "@tether-share/" in line}


def test_three_ranks_under_tether_run_map_one_copy_built_once(tmp_path):
    log = tmp_path / "builds"
    done = tether_run("ok", str(log))
    assert done.returncode == 0, done.stderr
    got = reports(done.stdout)
    assert sorted(got) == [0, 1, 2], done.stdout
    assert len(builds(log)) == 1
    assert len({r["inode"] for r in got.values()}) == 1
    assert {r["len"] for r in got.values()} == {"1000"}
    assert "@" + got[0]["name"] not in meeting_points()  # gone with the job


def test_ranks_that_ask_after_the_builder_has_exited_map_its_copy_under_tether_run(tmp_path):
    # build() returns at once and every rank exits as soon as it has the copy: ranks that
    # start late find the builder gone, and map what the job's vault keeps.
    log = tmp_path / "builds"
    for _ in range(3):
        done = tether_run("quick", str(log), ranks=4)
        assert done.returncode == 0, done.stderr
        assert len({r["inode"] for r in reports(done.stdout).values()}) == 1
    assert len(builds(log)) == 3  # once per job


def test_a_build_that_raises_raises_the_same_error_in_every_rank(tmp_path):
    log = tmp_path / "builds"
    done = tether_run("raise", str(log))
    assert done.returncode == 0, done.stderr
    raised = re.findall(r"rank=(\d) raised (.*?) \| (.*)", done.stdout)
    assert sorted(rank for rank, _, _ in raised) == ["0", "1", "2"], done.stdout
    assert {error for _, error, _ in raised} == {"ValueError: no such dataset: imagenet"}
    (builder,) = builds(log)
    builder_rank, builder_pid, _ = builder.split()
    for rank, _, cause in raised:
        if rank != builder_rank:  # a waiter: the builder's traceback is the cause
            assert cause == (
                f"build() of tether.share(key='imagenet') in rank {builder_rank} "
                f"(pid {builder_pid}) raised:"
            )


def test_a_builder_killed_while_building_ends_the_job_without_a_hang(tmp_path):
    log = tmp_path / "builds"
    done = tether_run("die", str(log))
    assert done.returncode == 128 + signal.SIGKILL, done.stderr
    first_builder = builds(log)[0].split()[0]
    assert f"rank {first_builder} failed first" in done.stderr
    assert "signal SIGKILL" in done.stderr


def plain_ranks(
    mode: str, log: Path, ranks: int, job: Optional[str] = None, **popen
) -> List[subprocess.Popen]:
    """Ranks of a job of plain processes (no launcher): the environment names the job."""
    env = dict(os.environ, TETHER_JOB_ID=job or uuid.uuid4().hex)
    return [
        subprocess.Popen(
            [sys.executable, SCRIPT, mode, str(log)],
            env=dict(env, RANK=str(rank)), text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen,
        )  # fmt: skip
        for rank in range(ranks)
    ]


def test_when_the_builder_dies_a_waiting_rank_builds_instead_and_says_so(tmp_path):
    log = tmp_path / "builds"
    procs = plain_ranks("die-once", log, 3)
    outs = [proc.communicate(timeout=60) for proc in procs]
    dead = [i for i, proc in enumerate(procs) if proc.returncode == -signal.SIGKILL]
    assert len(dead) == 1, outs
    (first, second) = builds(log)
    dead_rank, dead_pid, _ = first.split()
    assert int(dead_rank) == dead[0] and int(dead_pid) == procs[dead[0]].pid
    survivors = [reports(out) for i, (out, _) in enumerate(outs) if i != dead[0]]
    assert len({next(iter(r.values()))["inode"] for r in survivors}) == 1
    new_rank, new_pid, _ = second.split()
    warning = (
        f"tether.share(key='imagenet'): rank {dead_rank} (pid {dead_pid}), which was "
        "building it, was killed by signal SIGKILL (Killed) before it was done"
    )
    assert warning in outs[int(new_rank)][1]
    assert f"rank {new_rank} (pid {new_pid}) builds it instead" in outs[int(new_rank)][1]


def test_a_late_rank_maps_the_copy_after_the_builder_has_exited(tmp_path):
    log, job = tmp_path / "builds", uuid.uuid4().hex
    (builder,) = plain_ranks("hold", log, 1, job, stdin=subprocess.PIPE)
    first = reports(builder.stdout.readline())
    (holder,) = plain_ranks("hold", log, 1, job, stdin=subprocess.PIPE)
    second = reports(holder.stdout.readline())
    builder.communicate(input="", timeout=30)  # the builder exits
    (late,) = plain_ranks("ok", log, 1, job)
    out, _ = late.communicate(timeout=30)
    holder.communicate(input="", timeout=30)
    assert len(builds(log)) == 1
    inodes = {r["inode"] for got in (first, second, reports(out)) for r in got.values()}
    assert len(inodes) == 1
    assert "@" + first[0]["name"] not in meeting_points()  # the last holder is gone


def test_ranks_of_different_jobs_never_meet(tmp_path):
    log = tmp_path / "builds"
    launcher = str(Path(sys.executable).with_name("tether"))
    argv = [launcher, "run", "--nproc-per-node", "2", SCRIPT, "ok", str(log)]
    jobs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [job.communicate(timeout=100)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0]
    got = [reports(out) for out in outs]
    assert [sorted(g) for g in got] == [[0, 1], [0, 1]]
    per_job = [{r["inode"] for r in g.values()} for g in got]
    assert all(len(inodes) == 1 for inodes in per_job) and per_job[0] != per_job[1]
    assert len({line.split()[2] for line in builds(log)}) == 2 == len(builds(log))


def test_the_ranks_of_one_spawn_map_one_copy_built_once(start_method, tmp_path):
    log = tmp_path / "builds"
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    tether.start_processes(
        helpers.rank_builds, args=("imagenet", str(log), queue), nprocs=3,
        start_method=start_method,
    )  # fmt: skip
    got = sorted(queue.get() for _ in range(3))
    queue.close()
    assert [rank for rank, *_ in got] == [0, 1, 2]
    assert len(builds(log)) == 1
    assert len({frozenset(inodes) for _, inodes, _, _ in got}) == 1
    assert {(n, last) for _, _, n, last in got} == {(1000, helpers.sample(999))}


def test_without_a_job_the_key_form_builds_in_the_process_once():
    code = (
        "import tether\n"
        "calls = []\n"
        "build = lambda: calls.append(1) or [1, 2]\n"
        "a = tether.share(build, key='k'); b = tether.share(build, key='k')\n"
        "print(a is b, a == [1, 2], len(calls))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TETHER_JOB_ID"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["True", "True", "1"], out.stderr
