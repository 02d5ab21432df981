"""How a job of several nodes ends, for the rendezvous helper (``helper``): the records of
failures in a round's store, the choice of the job's root cause, and what a node that was away
learns when it comes back.

Every write here is a compare-and-set on the store (torch's ``compare_set``), never a plain
set, so that nodes writing at the same moment agree:

- ``tether.failure.<node>`` holds a node's first failure of the round. The launcher publishes
  it the moment it sees a rank fail, before it stops the node's other ranks; the report it
  makes once they stopped replaces it (the same rank, with everything it left on stderr).
- ``tether.end`` holds the job's root cause: the earliest failure in time on any node. It is
  written once, with an empty expected value, by the first node whose failure ends the job,
  after that node waited (up to `SETTLE` seconds) for every node still in the round to
  publish its failure; every other node reads the stored one. Only the failing node itself
  may later fill in its own record there.
- ``tether.lost.<node>`` says which node declared ``<node>`` lost (no heartbeat for the
  window) before it started a new round without it: the lost node reads it when it is back.

Records carry the wall-clock time at which the launcher saw the rank end (``time``); ties are
broken by node rank, then rank, so every node orders them alike.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional, Tuple

FAILURE = "tether.failure."
END = "tether.end"
# Each node sets it once it has read END (the node hosting the store waits for them).
END_SEEN = "tether.end_seen."
LOST = "tether.lost."
LEFT = "tether.left."
FINISHED = "tether.finished."
# A node's heartbeat: [a count that changes, its host].
ALIVE = "tether.alive."

#: How long a node whose failure ends the job waits for the other nodes' first failures
#: (a rank that died elsewhere a moment earlier may still be on its way to the store).
SETTLE = 3.0
POLL = 0.05


def order(record: Dict[str, Any]) -> Tuple[float, int, int]:
    return (float(record.get("time", 0.0)), int(record.get("node_rank", 0)), record["rank"])


def same(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    """Whether two records are of one rank's one end."""
    keys = ("node_rank", "rank", "pid", "attempt")
    return all(a.get(k) == b.get(k) for k in keys)


def put(store: Any, key: str, record: Dict[str, Any], replaces: Any) -> Dict[str, Any]:
    """Stores `record` at `key` by compare-and-set unless what is there already stays
    (`replaces(record, stored)` is false); returns what the store holds at the end."""
    desired = json.dumps(record)
    expected = ""
    for _ in range(100):
        now = store.compare_set(key, expected, desired).decode()
        if now == desired:
            return record
        stored: Dict[str, Any] = json.loads(now)
        if not replaces(record, stored):
            return stored
        expected = now
    return record


def publish(store: Any, node: int, record: Dict[str, Any]) -> Dict[str, Any]:
    """This node's first failure of the round (an earlier one wins; a later report of the
    same rank fills it in)."""
    return put(store, f"{FAILURE}{node}", record, earlier_or_same)


def earlier_or_same(new: Dict[str, Any], old: Dict[str, Any]) -> bool:
    return same(new, old) or order(new) < order(old)


def failures(store: Any, nodes: int) -> List[Dict[str, Any]]:
    """Every node's first failure of the round, earliest first."""
    keys = [f"{FAILURE}{n}" for n in range(nodes)]
    present = [k for k in keys if store.check([k])]
    found = [json.loads(v) for v in store.multi_get(present)] if present else []
    return sorted(found, key=order)


def decide(store: Any, me: int, nodes: int, own: Dict[str, Any]) -> Dict[str, Any]:
    """The job's root cause, once this node's failure ends the job: the earliest record in
    the round, once every node still in it published its own (or `SETTLE` passed, the
    node's heartbeat going on meanwhile), written once for all by compare-and-set; this
    node's own record is filled in if it is the one."""
    deadline = time.monotonic() + SETTLE
    records = failures(store, nodes)
    alive = f"{ALIVE}{me}"
    beat: List[Any] = json.loads(store.get(alive)) if store.check([alive]) else [0, ""]
    while time.monotonic() < deadline and not store.check([END]):
        # The node's patrol has stopped: its heartbeat goes on here, so that no node takes
        # it for lost (and starts a round without it) while it waits.
        beat[0] += 1
        store.set(alive, json.dumps(beat))
        heard = {r.get("node_rank") for r in records}
        gone = (FINISHED, LEFT, LOST)
        silent = [n for n in range(nodes) if n != me and n not in heard]
        if not [n for n in silent if not any(store.check([f"{k}{n}"]) for k in gone)]:
            break
        time.sleep(POLL)
        records = failures(store, nodes)
    first = min(records + [own], key=order)
    cause = put(store, END, first, lambda new, old: False)
    if same(cause, own) and cause != own:
        cause = put(store, END, own, lambda new, old: same(new, old))
    store.set(f"{END_SEEN}{me}", "1")
    return cause


def with_consequences(store: Any, nodes: int, cause: Dict[str, Any]) -> Dict[str, Any]:
    """The root cause, with the other nodes' failures (its consequences) in time order."""
    try:
        later = [r for r in failures(store, nodes) if not same(r, cause)]
    except Exception:  # noqa: BLE001 - the store is gone: the cause alone
        later = []
    keep = ("node_rank", "host", "rank", "local_rank", "pid", "exit", "code", "time", "error")
    brief = []
    for record in later:
        item = {k: record.get(k) for k in keep}
        lines = record.get("lines") or []
        if not item["error"] and lines:
            item["error"] = lines[-1]
        brief.append(item)
    return {**cause, "consequences": brief}


def take_end(store: Any, me: int, nodes: int) -> Optional[Dict[str, Any]]:
    """How the job ended (its root cause and consequences), marked as read by this node;
    None while it has not ended, or when no store answers."""
    try:
        if store is None or not store.check([END]):
            return None
        store.set(f"{END_SEEN}{me}", "1")
        cause: Dict[str, Any] = json.loads(store.get(END))
    except Exception:  # noqa: BLE001 - no store left to read
        return None
    return with_consequences(store, nodes, cause)


def declare_lost(store: Any, node: int, by: int, host: str, silent: float) -> None:
    """Says in the round's store that `by` (on `host`) declared `node` lost after `silent`
    seconds without a heartbeat (the first node to say so is kept)."""
    record = {"by": by, "host": host, "silent": silent, "time": time.time()}
    put(store, f"{LOST}{node}", record, lambda new, old: False)


def away_for(away: Optional[float]) -> str:
    how_long = "" if away is None else f" for {away:.0f} s"
    return f"this node was away{how_long} (stopped, or cut off from the store)"


def store_gone(away: float, endpoint: str) -> str:
    return (
        f"{away_for(away)}, and the store at {endpoint} no longer answers: the job ended or went "
        "on without it"
    )


def what_happened(store: Any, me: int, away: Optional[float], round_number: int) -> Optional[str]:
    """What the job did while this node was away for `away` seconds (stopped, or cut off from
    the store): a sentence when another node declared it lost, None when none did."""
    if not store.check([f"{LOST}{me}"]):
        return None
    lost = json.loads(store.get(f"{LOST}{me}"))
    return (
        f"{away_for(away)}; meanwhile node {lost['by']} ({lost['host']}) declared it lost "
        f"after {lost['silent']:g} s without its heartbeats and started round "
        f"{round_number + 1} without it"
    )


def missed(
    store: Any, me: int, away: Optional[float], round_number: int, cause: Any
) -> Optional[Dict[str, Any]]:
    """What node `me` missed while it was away (`away` seconds without the store, None when
    it was not): the sentence, and the job's root cause if the job ended meanwhile."""
    said = what_happened(store, me, away, round_number)
    if said is None and (cause is None or away is None):
        return None
    if said is None:
        said = f"{away_for(away)}; meanwhile the job ended"
    elif cause is not None:
        said += "; then the job ended"
    return {"why": said, "cause": cause}


def hold(store: Any, me: int, nodes: int, limit: float) -> None:
    """Once the job ended, the node hosting the store keeps it until every other node read
    the end (or finished, left, or stopped answering, `limit` s): none misses it and runs on."""
    try:
        if store is None or not store.check([END]):
            return
        others = [n for n in range(nodes) if n != me]
        deadline = time.monotonic() + limit
        while others and time.monotonic() < deadline:
            keys = (END_SEEN, FINISHED, LEFT)
            others = [n for n in others if not any(store.check([f"{k}{n}"]) for k in keys)]
            time.sleep(POLL)
    except Exception:  # noqa: BLE001 - the store is gone: nothing left to hold
        pass


def lost(why: str, nodes: int, opts: Dict[str, Any]) -> Dict[str, Any]:
    """The ``restart`` event for a node gone (`why`) from a round of `nodes` nodes:
    ``short`` when the nodes left are fewer than MIN (``opts["min_nodes"]``), so that no
    round can form until a node joins again."""
    return {"why": why, "short": nodes - 1 < int(opts["min_nodes"])}
