"""The choice of a job's root cause in a round's store (`tether.run.rendezvous.end`), against
torch's own TCPStore (in a child process, which takes the store's threads and sockets with
it): the earliest record wins whoever decides first, nodes deciding at the same moment read
one end, a first record is only filled in by its own node, and a node declared lost reads
what happened."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)

PREAMBLE = """
import datetime, json, threading
import torch.distributed as dist
from tether.run.rendezvous import end as end

server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
store = dist.PrefixStore("round.0.", server)

def record(node, at, rank=0):
    return {"node_rank": node, "host": "h", "rank": rank, "pid": 100 + node, "attempt": 0,
            "time": at, "code": 3 + node, "exit": f"exit code {3 + node}"}
"""


def in_a_store(body: str) -> Any:
    """Runs `body` after `PREAMBLE` in a child interpreter; what it printed last, as JSON."""
    code = PREAMBLE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_earliest_record_is_the_root_cause_though_a_later_node_decides_first() -> None:
    first, again, later = in_a_store(
        """
        end.publish(store, 0, record(0, 10.0))
        cause = end.decide(store, 1, 2, end.publish(store, 1, record(1, 10.5)))
        again = end.decide(store, 0, 2, record(0, 10.0))
        later = end.with_consequences(store, 2, cause)["consequences"]
        print(json.dumps([cause, again, later]))
        """
    )
    assert (first["node_rank"], first["code"]) == (0, 3)
    assert again["node_rank"] == 0
    assert [c["node_rank"] for c in later] == [1]


def test_nodes_deciding_at_the_same_moment_read_one_end() -> None:
    causes = in_a_store(
        """
        for n in range(3):
            end.publish(store, n, record(n, 20.0 + n / 1000))
        causes, go = [], threading.Barrier(3)
        def decide(n):
            go.wait()
            causes.append(end.decide(store, n, 3, record(n, 20.0 + n / 1000)))
        threads = [threading.Thread(target=decide, args=(n,)) for n in range(3)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        print(json.dumps(causes))
        """
    )
    assert [c["node_rank"] for c in causes] == [0, 0, 0]


def test_a_first_record_is_filled_in_by_its_own_node_and_never_replaced_by_a_later_one() -> None:
    later, full = in_a_store(
        """
        end.publish(store, 0, record(0, 5.0))
        later = end.publish(store, 0, record(0, 6.0, rank=1))
        full = end.publish(store, 0, {**record(0, 5.0), "lines": ["Segmentation fault"]})
        print(json.dumps([later, full]))
        """
    )
    assert later["time"] == 5.0
    assert full["lines"] == ["Segmentation fault"]


def test_a_node_declared_lost_reads_who_declared_it_and_which_round_went_on() -> None:
    before, after = in_a_store(
        """
        before = end.missed(store, 1, 25.0, 0, None)
        end.declare_lost(store, 1, 0, "hostA", 3.0)
        print(json.dumps([before, end.missed(store, 1, 25.0, 0, None)]))
        """
    )
    assert before is None and after["cause"] is None
    assert after["why"] == (
        "this node was away for 25 s (stopped, or cut off from the store); meanwhile node 0 "
        "(hostA) declared it lost after 3 s without its heartbeats and started round 1 "
        "without it"
    )
