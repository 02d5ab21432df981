"""What the rendezvous helper (``helper``) says to the launcher: the conversation, one JSON
object per line, and the wording of its failures to reach the endpoint or to join
(with the run ids other nodes joined under, which each node records at the endpoint)."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from typing import Any, Dict, List, NamedTuple, TextIO

NO_HOST = (
    ": no node hosts the store there (the node whose address is the endpoint's host hosts "
    "it, or the one given --rdzv-conf is_host=true)"
)


class Say:
    """The launcher's end of the conversation: one JSON object per line, tagged by its
    ``kind``, one method per message (the launcher reads them as one typed enum,
    ``Said`` in ``helper.rs``)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._lock = threading.Lock()

    def _line(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"kind": kind, **fields})
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()

    def round(self, round: int, place: Place) -> None:
        """Round ``round`` formed: this node's place in it."""
        self._line("round", round=round, **place._asdict())

    def restart(self, round: int, why: str, short: bool = False) -> None:
        """The membership of round ``round`` moved on (``why``); ``short`` when a node is
        gone and the nodes left are fewer than MIN."""
        self._line("restart", round=round, why=why, short=short)

    def ended(self, cause: Any) -> None:
        """Another node ended the job, with this root cause."""
        self._line("ended", cause=cause)

    def cause(self, cause: Any) -> None:
        """The job's root cause, after this node's final failure."""
        self._line("cause", cause=cause)

    def away(self, round: int, why: str, cause: Any) -> None:
        """The job moved on while this node was away (``why``); its root cause if it ended."""
        self._line("away", round=round, why=why, cause=cause)

    def bye(self) -> None:
        """Every node's ranks ended: the helper leaves."""
        self._line("bye")

    def error(self, message: str) -> None:
        """The rendezvous failed: a sentence naming the endpoint, the option or the node."""
        self._line("error", message=message)


class Place(NamedTuple):
    """A node's place in a round, as ``round`` says it."""

    group_rank: int
    group_world_size: int
    rank_base: int
    world_size: int
    role_rank_base: int
    role_world_size: int
    master_addr: str
    master_port: int
    agent_store: bool


def fail(say: Say, message: str) -> None:
    say.error(message)
    sys.stderr.flush()
    os._exit(1)


def call_with_deadline(say: Say, seconds: float, endpoint: str, what: str, fn: Any) -> Any:
    """``fn()``, or an error after `seconds`: torch's store client waits for ever on an
    endpoint that accepts connections and never answers."""
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported below, with the endpoint named
            box["error"] = exc

    thread = threading.Thread(target=run, name="tether-rdzv-connect", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if accepts(endpoint):
            fail(
                say,
                f"{what} accepted a connection but did not answer as a c10d store within "
                f"{seconds:g} s (read_timeout + 5): another service may listen there",
            )
        fail(say, f"cannot reach {what} within {seconds:g} s (read_timeout + 5){NO_HOST}")
    if "error" in box:
        raise box["error"]
    return box["value"]


def accepts(endpoint: str) -> bool:
    """Whether something accepts TCP connections at `endpoint` (HOST:PORT)."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or endpoint, int(port)), timeout=2):
            return True
    except (OSError, ValueError):
        return False


def hosts(endpoint: str) -> bool:
    """Whether this process hosts the store at `endpoint` (it listens on its port)."""
    port = endpoint.rsplit(":", 1)[-1]
    return port.isdigit() and listens_on(int(port))


def listens_on(port: int) -> bool:
    """Whether this process listens on TCP `port` (it hosts the store)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") in inodes:
                return True
        except OSError:
            continue
    return False


def innermost(exc: BaseException) -> BaseException:
    while (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return exc


def cause_text(exc: BaseException) -> str:
    """The real error (torch wraps it: "See inner exception for details")."""
    inner = innermost(exc)
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[0] if text else ''}"


# Keys in the endpoint's store itself, to name nodes that joined under another run id.
RUNS = "tether.runs"
RUN = "tether.run."


def announce_run_id(base_store: Any, run_id: str, host: str) -> None:
    """Records, at the endpoint, that a node of `host` joins under `run_id`."""
    if base_store is None:
        return
    try:
        index = base_store.add(RUNS, 1)
        base_store.set(f"{RUN}{index}", json.dumps([run_id, host]))
    except Exception:  # noqa: BLE001 - the store is torch's to complain about, at the join
        pass


def other_run_ids(base_store: Any, run_id: str) -> List[str]:
    """The other run ids nodes joined under at the endpoint, with their hosts."""
    if base_store is None:
        return []
    try:
        count = base_store.add(RUNS, 0)
        keys = [f"{RUN}{i}" for i in range(1, count + 1)]
        seen = [json.loads(v) for v in base_store.multi_get(keys)]
    except Exception:  # noqa: BLE001 - only a hint in a message
        return []
    return sorted({f"{run!r} (from {host})" for run, host in seen if run != run_id})


def join_timed_out(
    run_id: str, endpoint: str, join_timeout: float, min_nodes: int, others: List[str]
) -> str:
    """The round did not form in time; `others`: the run ids other nodes at the endpoint
    joined under."""
    also = ""
    if others:
        also = f"; nodes at this endpoint joined other run ids: {', '.join(others)}"
    return (
        f"the rendezvous of run {run_id!r} at {endpoint} did not "
        f"complete within join_timeout ({join_timeout:g} s): fewer than "
        f"{min_nodes} node(s) joined{also} (set it with --rdzv-conf "
        "join_timeout=SECONDS)"
    )


def join_failed(endpoint: str, exc: BaseException) -> str:
    """The joining failed otherwise (neither closed nor timed out)."""
    if "Connection was likely closed" in str(innermost(exc)):
        return (
            f"the store at {endpoint} closed the connection: the node that hosted it "
            "ended (its own rendezvous failed or finished)"
        )
    return f"the rendezvous at {endpoint} failed: {cause_text(exc)}"


def connect_hint(exc: BaseException) -> str:
    text = str(innermost(exc))
    if "invalid value returned from server" in text:
        return "; the service listening there is not a c10d store"
    if "timed out" in text or "refused" in text:
        return NO_HOST
    return ""
