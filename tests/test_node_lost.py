"""A node that leaves a multi-node ``tether run`` ends the job in seconds when no round can
form without it: two launchers on this machine form a job of ``--nnodes 2`` over torch's
c10d rendezvous; one node's launcher gets SIGTERM (it says goodbye) or SIGKILL (its
heartbeats stop); the other node, with no restart left, ends well within 30 s (not after
``join_timeout``, 600 s) with a root cause naming the lost node and its own ranks."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import List

import pytest
from test_multinode import ELASTIC, QUICK, Node, c10d, descendants, free_port, start, tether

from conftest import wait_gone

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_the_other_node_ends_in_seconds_naming_the_lost_node(
    tmp_path: Path, nodes: List[Node], sig: int
) -> None:
    port = free_port()
    argv = tether(
        *c10d(port, "lost", "2", conf=QUICK),
        "--nproc-per-node=2",
        "--max-restarts=0",
        "--grace-period=3",
        ELASTIC,
        "--sleep",
        "200",
    )
    survivor = start(nodes, tmp_path, argv)
    # The lost node does not host the store (the store's host going ends every node: see
    # test_multinode).
    guest = [a.replace(QUICK, QUICK + ",is_host=false") for a in argv]
    lost = start(nodes, tmp_path, guest)
    for node in (survivor, lost):
        node.wait_for("place RANK=.* WORLD_SIZE=4")
    ranks = "0..1" if "GROUP_RANK=0" in survivor.out else "2..3"
    left = sorted(descendants(lost.proc.pid))
    lost.proc.send_signal(sig)
    sent = time.monotonic()
    code = survivor.end(limit=60)
    took = time.monotonic() - sent
    assert took < 30, (took, survivor.err)
    assert code == 1, survivor.err
    assert re.search(
        r"tether: the job ends: node \d \(\S+\) (left the job|stopped answering for 3 s), and "
        r"the nodes left are fewer than --nnodes' MIN \(2\) with no restart left on this node "
        r"\(--max-restarts 0\); root cause: the lost node\. This node's 2 rank\(s\) were "
        rf"stopped \(ranks {re.escape(ranks)}\)",
        survivor.err,
    ), survivor.err
    assert lost.end() == (128 + sig if sig == signal.SIGTERM else -sig)
    assert wait_gone(left, 10) == [], "the lost node's processes outlived it"
    assert wait_gone(sorted(descendants(survivor.proc.pid)), 10) == []
