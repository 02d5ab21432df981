"""A gloo job on CPU for the tests of ``tether run``'s watch: ranks step in a loop (a nap
of ``WATCH_STEP`` seconds, varied by ``WATCH_JITTER`` either way, a batch from a
DataLoader, then ``dist.all_reduce``), and faults come at known steps.

``WATCH_PLAN`` lists the faults, ``STEP:KIND:RANK`` separated by commas; at step STEP, rank
RANK prints ``watch-fault KIND RANK PID TIME`` (TIME: ``time.time()``) and then:

- ``getitem``: sleeps in the dataset's ``__getitem__``;
- ``lock``: takes a lock it holds already;
- ``stop``: stops itself with SIGSTOP;
- ``spin``: spins on the CPU;
- ``wait``: waits on something (naps in a loop) while the others are in a barrier;
- ``collective``: goes to ``dist.barrier`` while the others are in ``dist.all_reduce`` (it
  never comes back: the last fault of a plan);
- ``slow``: from this step on, naps ``WATCH_FACTOR`` times as long as the others.

SIGUSR2 (SIGCONT after ``stop``) ends a fault: the rank prints ``watch-released`` and steps
on. Other settings: ``WATCH_STEPS``, the number of steps (then the job ends); ``WATCH_GC``,
every that many steps rank 1 pauses to collect garbage (a heap of cycles); ``WATCH_EPOCH``,
epochs of that many steps, twice and three times as many in turn, each ending in a
validation (a nap of 0.15 to 0.45 s on every rank) and a barrier."""

from __future__ import annotations

import gc
import os
import random
import signal
import threading
import time
from typing import Dict, Tuple

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset


class Release(Exception):  # noqa: N818 (a signal, not an error)
    """Raised by SIGUSR2 in the rank at fault."""


def release(signum: int, frame: object) -> None:
    raise Release()


FAULT = {"now": False}


class Numbers(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int) -> torch.Tensor:
        if FAULT["now"]:
            time.sleep(1000)  # watch: getitem
        return torch.ones(4)


def plan() -> Dict[int, Tuple[str, int]]:
    faults = {}
    for item in filter(None, os.environ.get("WATCH_PLAN", "").split(",")):
        step, kind, rank = item.split(":")
        faults[int(step)] = (kind, int(rank))
    return faults


def spin() -> None:
    x = 0
    while True:
        x += 1  # watch: spin


def wait_for_something() -> None:
    while True:
        time.sleep(0.05)  # watch: wait


def fault(kind: str, loader: "DataLoaderIter") -> None:
    if kind == "getitem":
        FAULT["now"] = True
        try:
            loader.next()
        finally:
            FAULT["now"] = False
    elif kind == "lock":
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # watch: lock
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        raise Release()
    elif kind == "spin":
        spin()
    elif kind == "wait":
        wait_for_something()


class DataLoaderIter:
    def __init__(self) -> None:
        self.loader = DataLoader(Numbers(), batch_size=2)
        self.it = iter(self.loader)

    def next(self) -> torch.Tensor:
        try:
            return next(self.it)
        except Release:
            self.it = iter(self.loader)
            raise


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    signal.signal(signal.SIGUSR2, release)
    step_time = float(os.environ.get("WATCH_STEP", "0.1"))
    jitter = float(os.environ.get("WATCH_JITTER", "0.25"))
    factor = float(os.environ.get("WATCH_FACTOR", "1"))
    steps = int(os.environ.get("WATCH_STEPS", "100"))
    gc_every = int(os.environ.get("WATCH_GC", "0"))
    epoch = int(os.environ.get("WATCH_EPOCH", "0"))
    faults = plan()
    next_epoch, epochs = epoch, []
    loader = DataLoaderIter()
    slow = 1.0
    junk = []
    tensor = torch.ones(16)
    print(f"watch-ready {rank} {os.getpid()}", flush=True)
    for step in range(steps):
        time.sleep(step_time * slow * random.uniform(1 - jitter, 1 + jitter))
        loader.next()
        kind, who = faults.get(step, ("", -1))
        if kind == "slow" and rank == who:
            slow = factor
        elif kind and rank == who:
            print(f"watch-fault {kind} {rank} {os.getpid()} {time.time():.3f}", flush=True)
            if kind == "collective":
                dist.barrier()  # watch: collective
            try:
                fault(kind, loader)
            except Release:
                print(f"watch-released {rank}", flush=True)
        if kind == "wait" and rank != who:
            dist.barrier()  # watch: barrier
        elif kind == "wait":
            dist.barrier()
        if gc_every and rank == 1 and step % gc_every == gc_every - 1:
            junk = [[[] for _ in range(200)] for _ in range(1000)]
            for item in junk:
                item.append(item)
            junk.clear()
            gc.collect()
        if epoch and step == next_epoch:
            # Epochs of different lengths, each ending in a validation on every rank.
            next_epoch += epoch * (1 + len(epochs) % 3)
            epochs.append(step)
            time.sleep(0.3 * random.uniform(0.5, 1.5))
            dist.barrier()
        dist.all_reduce(tensor)  # watch: all_reduce
    print(f"watch-done {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
