"""``tether.status()``: what tether runs now in this interpreter, and ``python -m tether
ps``: the processes tether started for this user on this machine, as a tree, from the
names they carry (``tether zygote ...``, ``tether rank 3: train ...``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple


@dataclass
class Child:
    """One process: its pid, what it is (rank, slot, role) and its state ("running", or how
    it ended)."""

    pid: int
    what: str
    state: str


@dataclass
class Zygote:
    pid: int
    preload: List[str]
    blanks: List[int]


@dataclass
class Group:
    """The ranks of one ``start_processes`` call."""

    what: str
    start_method: str
    ranks: List[Child]


@dataclass
class Pool:
    pool_id: int
    start_method: str
    workers: List[Child]


@dataclass
class Status:
    """What tether runs now in this interpreter (``print()`` it for a tree)."""

    pid: int
    zygotes: List[Zygote] = field(default_factory=list)
    pools: List[Pool] = field(default_factory=list)
    groups: List[Group] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"tether in pid {self.pid}"]
        from ._zygote_server import preload_summary

        for z in self.zygotes:
            lines.append(f"  zygote {z.pid} (preload: {preload_summary(z.preload)})")
            lines += [f"    blank {pid}" for pid in z.blanks]
        for p in self.pools:
            lines.append(f"  pool {p.pool_id} [{p.start_method}]")
            lines += [f"    {w.what} {w.pid}: {w.state}" for w in p.workers]
        for g in self.groups:
            lines.append(f"  {g.what} [{g.start_method}]")
            lines += [f"    {r.what} {r.pid}: {r.state}" for r in g.ranks]
        return "\n".join(lines)


#: What lists the pools of this process, once the pool's module is imported (this module
#: never imports it: a process that made no pool has none).
_pool_sources: List[Callable[[], List[Pool]]] = []


def add_pools(source: Callable[[], List[Pool]]) -> None:
    """``source`` lists pools for ``status()``."""
    _pool_sources.append(source)


def status() -> Status:
    """What tether runs now in this interpreter: its zygotes (pid, preload, the children
    they keep ready), its pools and their workers, and the groups of processes started by
    ``start_processes`` that are still running or not yet joined."""
    from . import _zygote
    from .spawn import live_contexts

    found = Status(os.getpid())
    for zygote in _zygote.running():
        pids = zygote.pids()
        if pids:
            found.zygotes.append(Zygote(pids[0], list(zygote.preload), pids[1:]))
    for pools in _pool_sources:
        found.pools += pools()
    for ctx in live_contexts():
        ranks = [
            Child(p.pid, f"rank {i}", "running" if p.status is None else str(p.status))
            for i, p in enumerate(ctx.processes)
        ]
        found.groups.append(Group(ctx.what, ctx.start_method, ranks))
    return found


# python -m tether ps ----------------------------------------------------------------------


def _processes(uid: int) -> Dict[int, Tuple[int, str, str]]:
    """pid -> (ppid, comm, command line) of every process of ``uid``."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        args = raw.replace(b"\0", b" ").decode(errors="replace").strip()
        table[int(entry)] = (ppid, comm, args.translate(_VISIBLE))
    return table


#: Control characters as they show in one line (a `python -c` program has newlines).
_VISIBLE = {c: f"\\x{c:02x}" for c in range(32)} | {ord("\n"): "\\n", ord("\t"): "\\t"}


#: The name a ``tether run`` supervisor has in /proc/PID/comm (its first 15 bytes of
#: "tether-supervisor").
SUPERVISOR_COMM = "tether-supervis"


def _is_tethers(comm: str, args: str) -> bool:
    """Whether a process is one tether started or runs (from its name), or a launcher."""
    if comm.startswith("tether") or args.startswith("tether "):
        return True
    words = args.split()
    return len(words) >= 2 and os.path.basename(words[0]) == "tether" and words[1] == "run"


def _rank_of(pid: int) -> str:
    """``rank N (local L)`` from a rank's environment, as ``tether run`` set it."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:
        return "rank ?"
    rank = env.get(b"RANK", b"?").decode(errors="replace")
    local = env.get(b"LOCAL_RANK")
    return f"rank {rank}" + (f" (local {local.decode(errors='replace')})" if local else "")


def tree(uid: Optional[int] = None) -> List[str]:
    """The lines of ``python -m tether ps``: tether's processes of ``uid`` (this user by
    default), each under the process that started it; a ``tether run`` job whole, its
    keeper, supervisor and every rank (with its rank number) and what the ranks started.
    The process that asks is left out."""
    table = _processes(os.getuid() if uid is None else uid)
    me = os.getpid()
    table.pop(me, None)
    children: Dict[int, List[int]] = {}
    for pid in sorted(table):
        children.setdefault(table[pid][0], []).append(pid)
    supervisors = {pid for pid, (_, comm, _) in table.items() if comm == SUPERVISOR_COMM}
    keepers = {table[pid][0] for pid in supervisors}
    ranks = {kid for pid in supervisors for kid in children.get(pid, [])}
    started = set(ranks)
    todo = list(ranks)
    while todo:
        for kid in children.get(todo.pop(), []):
            if kid not in started:
                started.add(kid)
                todo.append(kid)
    ours = {pid for pid, (_, comm, args) in table.items() if _is_tethers(comm, args)}
    ours |= started | keepers
    if not ours:
        return ["no process started by tether runs for this user"]
    labels = {pid: _rank_of(pid) + ": " for pid in ranks}
    labels.update({pid: "tether run keeper: " for pid in keepers})
    tree_children = {
        parent: [kid for kid in kids if kid in ours] for parent, kids in children.items()
    }
    roots = sorted({table[pid][0] for pid in ours} - ours)
    lines = [f"{'PID':>7}  WHAT"]
    for root in roots:
        args = table.get(root, (0, "", "?"))[2] or f"[{table.get(root, (0, '?', ''))[1]}]"
        lines.append(f"{root:>7}  {args}")
        lines += _branch(root, tree_children, table, labels, "")
    return lines


def _branch(
    pid: int,
    children: Dict[int, List[int]],
    table: Dict[int, Tuple[int, str, str]],
    labels: Dict[int, str],
    indent: str,
) -> Iterable[str]:
    kids = children.get(pid, [])
    for n, kid in enumerate(kids):
        last = n == len(kids) - 1
        what = labels.get(kid, "") + (table[kid][2] or f"[{table[kid][1]}]")
        yield f"{kid:>7}  {indent}{'└─ ' if last else '├─ '}{what}"
        yield from _branch(kid, children, table, labels, indent + ("   " if last else "│  "))


def ps_main(argv: List[str]) -> int:
    """``python -m tether ps``."""
    if argv:
        print("usage: python -m tether ps", flush=True)
        return 2
    print("\n".join(tree()))
    return 0
