"""A three-rank gloo job on CPU where two ranks wait in a collective and one never joins it,
for the tests of the stacks' summary: ``python culprit.py`` under ``tether run``, or
``spawned(i, port)`` under ``tether.start_processes``. Each rank prints ``ready RANK PID``
once in the group; then rank ``LATE`` naps in ``nap`` (the line marked ``# culprit: nap``)
while the others wait in ``dist.all_reduce`` (``# culprit: all_reduce``). Every wait ends
after ``LIMIT`` seconds. Under ``tether run``, rank ``LATE`` prints ``tick`` from a thread,
from its first line (torch is imported after), until the file ``$CULPRIT_QUIET`` exists, so
that ``--stall-timeout`` only counts from then."""

from __future__ import annotations

import datetime
import os
import threading
import time

LATE = 2
LIMIT = 120.0
FILE = __file__


def nap(limit: float) -> None:
    time.sleep(limit)  # culprit: nap


def work(rank: int) -> None:
    import torch
    import torch.distributed as dist

    print(f"ready {rank} {os.getpid()}", flush=True)
    if rank == LATE:
        nap(LIMIT)
    else:
        dist.all_reduce(torch.ones(1))  # culprit: all_reduce


def tick(quiet: str) -> None:
    while not os.path.exists(quiet):
        print("tick", flush=True)
        time.sleep(0.5)


def spawned(rank: int, port: int) -> None:
    """A rank of ``tether.start_processes(spawned, args=(port,), nprocs=3)``."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=3,
        timeout=datetime.timedelta(seconds=LIMIT),
    )
    work(rank)


def line_of(mark: str) -> int:
    """The line marked ``# culprit: MARK``."""
    with open(FILE) as f:
        for number, line in enumerate(f, start=1):
            if line.rstrip().endswith(f"# culprit: {mark}"):
                return number
    raise ValueError(mark)


def main() -> None:
    """A rank of ``tether run -n 3 culprit.py``."""
    if int(os.environ["RANK"]) == LATE:
        threading.Thread(target=tick, args=(os.environ["CULPRIT_QUIET"],), daemon=True).start()
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=LIMIT))
    work(dist.get_rank())


if __name__ == "__main__":
    main()
