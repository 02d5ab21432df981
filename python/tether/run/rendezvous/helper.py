"""One node's side of a dynamic rendezvous, for `tether run` (``python -m tether.run.rendezvous``).

The launcher (Rust) starts it once per node, with the ranks' interpreter, for torchrun's
dynamic forms (``--rdzv-backend c10d``, ``etcd``, ``etcd-v2`` on several nodes, or an elastic
``--nnodes MIN:MAX``). Joining, node ranks, heartbeats, the last call and the rounds are
torch's own (`torch.distributed.elastic.rendezvous`, built as torchrun builds it), so
``tether run`` and ``torchrun`` nodes form one job; the launcher keeps the ranks, their
output and the reports. It talks to the launcher in JSON lines: commands on stdin, answers
and events on stdout (its own prints go to stderr).

Commands: ``{"cmd": "next"}`` joins the next round; ``{"cmd": "failing", "record": {...}}``
publishes a rank's failure the moment the launcher sees it; ``{"cmd": "failed", "record":
{...}, "final": bool}`` records the failure once the node's ranks stopped (``final``: no
restart is left, the job ends); ``{"cmd": "done"}`` says this node's ranks succeeded;
``{"cmd": "leave"}`` (or the end of stdin, or SIGTERM) leaves the job.

Answers and events (one method of ``say.Say`` each): ``round`` (this node's place in the
round that formed), ``restart``
(the membership moved on: nodes wait to join, a node left or stopped answering), ``ended``
(another node ended the job; its root cause), ``cause`` (the job's root cause, after a final
failure), ``away`` (the job moved on while this node was away: a sentence, and the root cause
if the job ended), ``bye``, and ``error`` (a message naming the endpoint, the option or the
node). How the job's end is chosen is `end`'s.

Rounds: torch shares its TCPStore with the ranks, which breaks later rounds (nobody
publishes the master address again; restart counts that differ give different prefixes),
so only round 0 is torch's exactly; each later round gets a store of its own.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, TextIO

from . import end, torch_rdzv
from .end import ALIVE, FINISHED, LEFT, declare_lost, lost
from .say import (
    Place,
    Say,
    announce_run_id,
    call_with_deadline,
    cause_text,
    connect_hint,
    fail,
    hosts,
    join_failed,
    join_timed_out,
    other_run_ids,
)

# Keys this helper keeps in each round's store, beside torch's own and those of
# `end` (the heartbeats' among them).
# torch's agents wait for each other there when their ranks succeeded.
TERMINAL_STATE = "torchelastic/agent/terminal_state"

PATROL_EVERY = 0.1


class Node:
    """This node in the job: torch's handler, the store of the round, and the patrol."""

    def __init__(self, opts: Dict[str, Any], say: Say) -> None:
        self.opts = opts
        self.say = say
        self.endpoint = opts["endpoint"]
        self.run_id = opts["run_id"]
        self.host = socket.gethostname()
        self.handler: Any = None
        self.base_store: Any = None
        self.store: Any = None
        self.group_rank = -1
        self.nodes = 0
        self.rounds = 0
        self.joined = 0  # the number of the round this node joined last
        self.patrol_stop = threading.Event()
        self.patroller: Optional[threading.Thread] = None

    # -- joining ------------------------------------------------------------------------

    def build(self) -> None:
        conf = torch_rdzv.rendezvous_conf(self.opts)
        self.read_timeout = float(conf.get("read_timeout", 60))
        self.join_timeout = float(conf.get("join_timeout", 600))
        interval = float(conf.get("keep_alive_interval", 5))
        self.dead_after = interval * float(conf.get("keep_alive_max_attempt", 3))
        params = torch_rdzv.parameters(self.opts, conf)
        what = f"the rendezvous endpoint {self.endpoint} ({self.opts['backend']})"
        reach = f"cannot reach {what} within read_timeout ({self.read_timeout:g} s)"
        try:
            if params.backend == "c10d":
                self.handler = call_with_deadline(
                    self.say,
                    self.read_timeout + 5,
                    self.endpoint,
                    what,
                    lambda: self.c10d_handler(params),
                )
            else:
                from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

                self.handler = get_rendezvous_handler(params)
        except Exception as exc:  # noqa: BLE001 - reported, with the endpoint named
            fail(self.say, f"{reach}: {cause_text(exc)}{connect_hint(exc)}")
        announce_run_id(self.base_store, self.run_id, self.host)

    def c10d_handler(self, params: Any) -> Any:
        handler, self.base_store = torch_rdzv.c10d_handler(params, self.opts["max_nodes"])
        return handler

    def next_round(self) -> None:
        self.stop_patrol()
        handler = self.handler
        if self.rounds > 0 and hasattr(handler, "_bootstrap_store_info"):
            # torch publishes the master address once; the node that is rank 0 of this
            # round publishes it again (a late node would wait for it for ever).
            handler._bootstrap_store_info = None
            handler._shared_tcp_store_server = None
        try:
            info = handler.next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - reported, by its kind
            self.joining_failed(exc)
            return
        self.rounds += 1
        self.joined = self.round_number()
        self.store = info.store
        self.group_rank, self.nodes = info.rank, info.world_size
        ranks = torch_rdzv.assign_ranks(
            self.store, self.group_rank, self.nodes, self.opts["role"], self.opts["nproc"]
        )
        addr, port, agent = torch_rdzv.master(
            self.handler, info, self.group_rank, self.round_number(), self.opts.get("local_addr")
        )
        self.store.set(f"{ALIVE}{self.group_rank}", json.dumps([0, self.host]))
        base, world, role_base, role_world = ranks
        place = Place(
            self.group_rank, self.nodes, base, world, role_base, role_world, addr, port, agent
        )
        self.say.round(self.round_number(), place)
        self.start_patrol()

    def joining_failed(self, exc: BaseException) -> None:
        from torch.distributed.elastic.rendezvous.api import (
            RendezvousClosedError,
            RendezvousTimeoutError,
        )

        if isinstance(exc, RendezvousClosedError):
            cause = self.take_end(self.store)
            if cause is not None:
                self.say.ended(cause)
                self.hold_the_end()
                os._exit(0)
            fail(self.say, f"the rendezvous of run {self.run_id!r} at {self.endpoint} is closed")
        if isinstance(exc, RendezvousTimeoutError):
            others = other_run_ids(self.base_store, self.run_id)
            message = join_timed_out(
                self.run_id, self.endpoint, self.join_timeout, self.opts["min_nodes"], others
            )
            self.say.error(message)
            # The node hosting the store keeps it a while, so that the others reach their
            # own join timeout and can say which run ids they met.
            if hosts(self.endpoint):
                time.sleep(min(self.join_timeout, 10.0))
            os._exit(1)
        fail(self.say, join_failed(self.endpoint, exc))

    def hold_the_end(self) -> None:
        """Once the job ended, the node hosting the store keeps it until every node read it."""
        if hosts(self.endpoint):
            end.hold(self.store, self.group_rank, self.nodes, self.dead_after + 1)

    def round_number(self) -> int:
        holder = getattr(self.handler, "_state_holder", None)
        state = getattr(holder, "state", None)
        return int(getattr(state, "round", self.rounds - 1))

    # -- patrolling the round------------------------------------------------------------

    def start_patrol(self) -> None:
        self.patrol_stop = threading.Event()
        self.patroller = threading.Thread(
            target=self.patrol,
            args=(self.store, self.patrol_stop),
            name="tether-rdzv-patrol",
            daemon=True,
        )
        self.patroller.start()

    def stop_patrol(self) -> None:
        self.patrol_stop.set()
        if self.patroller is not None:
            self.patroller.join()
            self.patroller = None

    def patrol(self, store: Any, stop: threading.Event) -> None:
        beats: Dict[int, Any] = {}
        seen: Dict[int, float] = {}
        count, failing_since, last = 0, 0.0, time.monotonic()
        while not stop.wait(PATROL_EVERY):
            count += 1
            away = time.monotonic() - last
            try:
                why = self.moved_on(store, count, beats, seen, away)
                failing_since, last = 0.0, time.monotonic()
            except Exception as exc:  # noqa: BLE001 - a store silent for read_timeout ends it
                failing_since = failing_since or time.monotonic()
                silent = time.monotonic() - failing_since
                if away > self.dead_after and silent > min(self.dead_after, self.read_timeout):
                    gone = end.store_gone(failing_since - last, self.endpoint)
                    self.say.away(self.round_number(), gone, None)
                    return
                if silent < self.read_timeout:
                    continue
                print(
                    f"tether: the rendezvous store at {self.endpoint} stopped answering "
                    f"({cause_text(exc)}); the ranks go on",
                    file=sys.stderr,
                    flush=True,
                )
                return
            if why is None:
                continue
            why()
            return

    def moved_on(
        self, store: Any, count: int, beats: Dict[int, Any], seen: Dict[int, float], away: float
    ) -> Optional[Callable[[], None]]:
        """What to say if the round moved on (a message of ``say``, ready to send)."""
        store.set(f"{ALIVE}{self.group_rank}", json.dumps([count, self.host]))
        cause, round = self.take_end(store), self.round_number()
        missed = self.missed(store, away if away > self.dead_after else None, cause)
        if missed is not None:
            return functools.partial(self.say.away, round, **missed)
        if cause is not None:
            return functools.partial(self.say.ended, cause)
        now = time.monotonic()
        for node in range(self.nodes):
            if node == self.group_rank or store.check([f"{FINISHED}{node}"]):
                continue
            if store.check([f"{LEFT}{node}"]):
                host = json.loads(store.get(f"{LEFT}{node}"))
                why = f"node {node} ({host}) left the job"
                return functools.partial(
                    self.say.restart, round, **lost(why, self.nodes, self.opts)
                )
            if not store.check([f"{ALIVE}{node}"]):
                continue
            beat = store.get(f"{ALIVE}{node}")
            if beats.get(node) != beat:
                beats[node], seen[node] = beat, now
            elif now - seen[node] > self.dead_after:
                host = json.loads(beat)[1]
                why = f"node {node} ({host}) stopped answering for {self.dead_after:g} s"
                declare_lost(store, node, self.group_rank, self.host, self.dead_after)
                return functools.partial(
                    self.say.restart, round, **lost(why, self.nodes, self.opts)
                )
        waiting = self.handler.num_nodes_waiting()
        if waiting:
            why = f"{waiting} node(s) wait for a new round (joining, or restarting after a failure)"
            return functools.partial(self.say.restart, round, why)
        return None

    def take_end(self, store: Any) -> Any:
        """How the job ended (its root cause and consequences), marked as read by this node;
        None while it has not ended, or when no store answers."""
        return end.take_end(store, self.group_rank, self.nodes)

    def missed(self, store: Any, away: Optional[float], cause: Any) -> Optional[Dict[str, Any]]:
        """What this node missed while away (`away` s, or None): see `end`."""
        return end.missed(store, self.group_rank, away, self.joined, cause)

    # -- the end of an attempt ----------------------------------------------------------

    def failing(self, record: Dict[str, Any]) -> None:
        """A rank of this node failed: its record goes to the store at once, before the
        launcher stops the node's other ranks (the patrol goes on meanwhile)."""
        record = {**record, "node_rank": self.group_rank, "host": self.host}
        try:
            end.publish(self.store, self.group_rank, record)
        except Exception:  # noqa: BLE001 - the store is gone: the report says the rest
            pass

    def failed(self, record: Dict[str, Any], final: bool) -> None:
        """This node's ranks stopped after a failure: its full record replaces the first
        one; with no restart left, the job ends on the earliest failure of any node."""
        self.stop_patrol()
        record = {**record, "node_rank": self.group_rank, "host": self.host}
        me, store = self.group_rank, self.store
        try:
            end.publish(store, me, record)
            if not final:
                return
            missed = self.missed(store, None, self.take_end(store))
            if missed is not None:
                self.say.away(self.round_number(), **missed)
                return
            cause = end.decide(store, me, self.nodes, record)
            cause = end.with_consequences(store, self.nodes, cause)
            self.handler.set_closed()
        except Exception:  # noqa: BLE001 - the store is gone: this node's record
            cause = record
        self.say.cause(cause)

    def done(self) -> None:
        """Waits for every node's ranks to end (the node hosting the store keeps it for the
        others) in torch's agent's own exit barrier, so that torchrun nodes of the job are
        let go too; another node's final failure ends the wait."""
        from torch.distributed.elastic.utils.store import barrier

        self.stop_patrol()
        passed = threading.Event()

        def wait_for_everyone() -> None:
            try:
                barrier(self.store, self.nodes, TERMINAL_STATE, self.opts.get("exit_barrier", 300))
            except Exception:  # noqa: BLE001 - timed out, or the store's host finished and went
                pass
            passed.set()

        try:
            self.store.set(f"{FINISHED}{self.group_rank}", "1")
            threading.Thread(target=wait_for_everyone, daemon=True).start()
            while not passed.wait(PATROL_EVERY):
                cause = self.take_end(self.store)
                missed = self.missed(self.store, None, None)
                if missed is not None:
                    self.say.away(self.round_number(), **missed)
                    return
                if cause is not None:
                    self.say.ended(cause)
                    self.hold_the_end()
                    return
        except Exception:  # noqa: BLE001 - the store's host finished and went: nothing to wait for
            pass
        self.say.bye()

    def leave(self) -> None:
        self.patrol_stop.set()
        if self.store is not None and self.group_rank >= 0:
            try:
                self.store.set(f"{LEFT}{self.group_rank}", json.dumps(self.host))
            except Exception:  # noqa: BLE001 - leaving anyway
                pass


def serve(node: Node, commands: TextIO) -> None:
    for line in commands:
        if not line.strip():
            continue
        msg = json.loads(line)
        cmd = msg.get("cmd")
        if cmd == "next":
            node.next_round()
        elif cmd == "failing":
            node.failing(msg["record"])
        elif cmd == "failed":
            node.failed(msg["record"], bool(msg.get("final")))
        elif cmd == "done":
            node.done()
            return
        elif cmd == "leave":
            node.hold_the_end()
            break
    node.leave()


def main(argv: List[str]) -> None:
    opts = json.loads(argv[1])
    # torch's C++ store client warns, with a stack, when a store it polls goes away (the
    # node that hosted it finished): this helper says what matters itself.
    torch_rdzv.quiet_cpp_logs()
    # Answers go on the original stdout; anything else printed goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    say = Say(out)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    node = Node(opts, say)

    def on_term(signum: int, frame: Any) -> None:
        node.leave()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    node.build()
    serve(node, sys.stdin)
    sys.stdout.flush()
    os._exit(0)
