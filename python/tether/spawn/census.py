"""The census behind ``tether.status()``: what tether runs now in this interpreter
(``tether ps``, the launcher's, lists what tether runs for this user on this machine)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, List


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
        from tether.zygote.server import preload_summary

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
    from tether.zygote import client

    from . import live_contexts

    found = Status(os.getpid())
    for zygote in client.running():
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
