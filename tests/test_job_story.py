"""What ``tether run`` says about a job of several nodes is true on every node: the root
cause is the first failure in time on any node (published before the node stops its other
ranks, chosen once by compare-and-set), later failures are listed as its consequences, and a
node that was away (frozen past the heartbeat window) learns how the job went on. Launchers on
this machine act as nodes on 127.0.0.1; each case runs a few times."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import List, Tuple

import pytest
from test_multinode import (
    QUICK,
    SCRIPTS,
    Node,
    c10d,
    descendants,
    free_port,
    signal_each,
    start,
    tether,
)

pytestmark = pytest.mark.timeout(300)

CRASH = str(SCRIPTS / "broadcast_crash.py")
TOGETHER = str(SCRIPTS / "fail_together.py")
ELASTIC = str(SCRIPTS / "elastic_rank.py")
ROOT = re.compile(
    r"tether run: rank (\d+)(?: on node \d+)? failed first.*?"
    r"\n  pid\s+: (\d+)\n  exit\s+: ([^\n]*)",
    re.S,
)
LATER = "later failures on the job's nodes (consequences), in time order"


def root_cause(node: Node) -> Tuple[str, str, str]:
    """The rank, pid and exit of the root cause that `node` reported (it reports one)."""
    found = ROOT.findall(node.err)
    assert len(found) == 1, node.err
    return found[0]


def test_a_crashed_rank_is_the_root_cause_on_every_node_though_its_own_node_stopped_last(
    tmp_path: Path, nodes: List[Node]
) -> None:
    # Node A (2 ranks) loses its rank 0 to SIGSEGV and takes 3 s to stop its other rank (a
    # checkpoint); node B's rank fails at once with gloo's error: a consequence.
    for run in range(3):
        common = [*c10d(free_port(), f"crash{run}"), "--grace-period=15"]
        a = start(
            nodes, tmp_path, tether(*common, "--nproc-per-node=2", CRASH, "--checkpoint", "3")
        )
        b = start(
            nodes, tmp_path, tether(*common, "--nproc-per-node=1", CRASH, "--checkpoint", "3")
        )
        codes = [a.end(limit=120), b.end(limit=120)]
        crashed = min(re.findall(r"rank (\d+) of 3 pid (\d+)", a.out), key=lambda r: int(r[0]))
        consequence = re.findall(r"rank (\d+) of 3 pid (\d+)", b.out)
        assert codes == [128 + signal.SIGSEGV] * 2, (run, a.err, b.err)
        for node in (a, b):
            assert root_cause(node) == (*crashed, "signal SIGSEGV"), (run, node.err)
            later = node.err[node.err.index(LATER) :]
            assert f"rank {consequence[0][0]} on node" in later, (run, node.err)
            assert f"pid {consequence[0][1]}" in later, (run, node.err)


def test_nodes_whose_ranks_fail_at_the_same_moment_name_one_root_cause_and_exit_with_its_code(
    tmp_path: Path, nodes: List[Node]
) -> None:
    for run in range(3):
        trigger = tmp_path / f"fail{run}"
        argv = tether(
            *c10d(free_port(), f"same{run}", "3"), "--nproc-per-node=1", TOGETHER, str(trigger)
        )
        three = [start(nodes, tmp_path, argv) for _ in range(3)]
        for node in three:
            node.wait_for("waits")
        trigger.touch()
        codes = [node.end(limit=60) for node in three]
        roots = [root_cause(node) for node in three]
        assert len(set(codes)) == 1 and len(set(roots)) == 1, (run, codes, roots)
        # The exit code is the reported rank's own (3 plus its node rank).
        reporter = next(n for n in three if f"pid {roots[0][1]} waits" in n.out)
        assert f"of node {codes[0] - 3} fails on purpose" in reporter.err, (run, reporter.err)


def freeze(node: Node) -> List[int]:
    """Stops every process of `node` at once, as a machine that stops answering."""
    frozen = sorted({node.proc.pid} | descendants(node.proc.pid))
    signal_each(frozen, signal.SIGSTOP)
    return frozen


def two_sleeping_nodes(
    tmp_path: Path, nodes: List[Node], run_id: str, join_timeout: int, restarts: int
) -> Tuple[Node, Node]:
    """A host and a guest node of one rank each, their ranks asleep, both in place."""
    port, conf = free_port(), f"{QUICK},join_timeout={join_timeout}"
    script = ["--nproc-per-node=1", f"--max-restarts={restarts}", ELASTIC, "--sleep", "60"]
    host, guest = (
        start(nodes, tmp_path, tether(*c10d(port, run_id, conf=f"{conf},is_host={h}"), *script))
        for h in ("true", "false")
    )
    for node in (host, guest):
        node.wait_for("place RANK=")
    return host, guest


def test_a_node_frozen_past_the_heartbeat_window_learns_on_resuming_that_the_job_went_on_without_it(
    tmp_path: Path, nodes: List[Node]
) -> None:
    # A restart left: the host waits for a node to join, up to join_timeout.
    host, guest = two_sleeping_nodes(tmp_path, nodes, "away", join_timeout=8, restarts=1)
    frozen = freeze(guest)
    try:
        host.wait_for("stopped answering for 3 s", limit=30)
        host.wait_for("round 1 of run away|not counted as a restart", limit=30)
        time.sleep(1)
    finally:
        signal_each(frozen, signal.SIGCONT)
    assert guest.end(limit=60) == 1, guest.err
    assert re.search(
        r"this node was away for \d+ s .*; meanwhile node \d \(\S+\) declared it lost after 3 s "
        r"without its heartbeats and started round 1 without it; this node's ranks were stopped",
        guest.err,
    ), guest.err
    assert "the job went on without this node" in guest.err
    # The job itself ends on the host's join timeout, with the same exit status.
    assert host.end(limit=60) == 1, host.err
    assert "join_timeout" in host.err, host.err


def test_a_node_lost_with_no_restart_left_ends_the_job_at_once_naming_the_lost_node(
    tmp_path: Path, nodes: List[Node]
) -> None:
    host, guest = two_sleeping_nodes(tmp_path, nodes, "lost", join_timeout=60, restarts=0)
    frozen = freeze(guest)
    try:
        started = time.monotonic()
        # Well before join_timeout: no round can form, and no restart is left.
        assert host.end(limit=30) == 1, host.err
        assert time.monotonic() - started < 30
    finally:
        signal_each(frozen, signal.SIGCONT)
    assert re.search(
        r"the job ends: node \d \(\S+\) stopped answering for 3 s, and the nodes left are fewer "
        r"than --nnodes' MIN \(2\) with no restart left on this node \(--max-restarts 0\); "
        r"root cause: the lost node",
        host.err,
    ), host.err
    assert guest.end(limit=60) == 1, guest.err
    assert re.search(
        r"this node was away for \d+ s .*no longer answers: the job ended or went on without it",
        guest.err,
    ), guest.err


def test_a_node_frozen_while_the_job_ended_reports_the_jobs_root_cause_when_it_resumes(
    tmp_path: Path, nodes: List[Node]
) -> None:
    port = free_port()
    trigger = tmp_path / "fail now"
    conf = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"
    common = ["--nproc-per-node=1", ELASTIC]
    failing = [*common, "--fail-here", "--fail-after", "0", "--fail-when", str(trigger)]
    host = start(
        nodes, tmp_path, tether(*c10d(port, "gone", conf=conf + ",is_host=true"), *failing)
    )
    guest = start(
        nodes, tmp_path, tether(*c10d(port, "gone", conf=conf + ",is_host=false"), *common)
    )
    for node in nodes:
        node.wait_for("place RANK=")
    frozen, since = freeze(guest), time.monotonic()
    try:
        trigger.touch()
        host.wait_for("failed first", limit=30)
        # Away for longer than the heartbeats' window (2 s), however soon the host ended.
        time.sleep(max(0.0, 3.0 - (time.monotonic() - since)))
    finally:
        signal_each(frozen, signal.SIGCONT)
    assert [guest.end(limit=60), host.end(limit=60)] == [3, 3], guest.err + host.err
    assert re.search(r"this node was away for \d+ s .*; meanwhile the job ended", guest.err), (
        guest.err
    )
    assert root_cause(guest) == root_cause(host), guest.err + host.err
