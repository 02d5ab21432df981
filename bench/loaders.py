"""DataLoaders on tether.Pool against torch's own workers, in the same run.

    python bench/loaders.py [--reps N] [--spawn-reps N] [--batches N]

1. Twenty DataLoaders (64 small items, batch 16, 2 workers) iterated one after the other:
   torch fork, torch fork with persistent_workers, torch spawn (``--spawn-reps``, slow),
   the seed's ``reusable_pool_context`` over a ``torch.multiprocessing.Pool`` when it is
   there, and ``tether.Pool``. The pools are made (and warmed with one loader) before the
   clock starts.
2. Time to the first batch of a new loader.
3. Steady-state throughput of one loader of 32 x 3x224x224 float batches.

Each figure is the median over repetitions; within a repetition the contenders take
turns, so that a busy moment of the machine hits them alike. Ratios are against tether."""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Callable, Dict, Iterator, List, Optional

import torch
from _table import print_versus
from torch.utils.data import DataLoader, Dataset

import tether

SEEDS = "/work/shared/seeds"


class Small(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((8,), float(i))


class Images(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.empty(3, 224, 224).fill_(float(i))


def twenty(**kwargs) -> float:
    start = time.perf_counter()
    for _ in range(20):
        for _batch in DataLoader(Small(), batch_size=16, num_workers=2, **kwargs):
            pass
    return time.perf_counter() - start


def first_batch(**kwargs) -> float:
    start = time.perf_counter()
    it = iter(DataLoader(Small(), batch_size=16, num_workers=2, **kwargs))
    next(it)
    elapsed = time.perf_counter() - start
    del it
    return elapsed


def throughput(batches: int, **kwargs) -> float:
    loader = DataLoader(Images(32 * (batches + 4)), batch_size=32, num_workers=2, **kwargs)
    it = iter(loader)
    for _ in range(4):
        next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    elapsed = time.perf_counter() - start
    del it
    return batches / elapsed


def interleaved(contenders: Dict[str, Callable[[], float]], reps: int) -> Dict[str, float]:
    samples: Dict[str, List[float]] = {name: [] for name in contenders}
    for _ in range(reps):
        for name, run in contenders.items():
            samples[name].append(run())
    return {name: statistics.median(values) for name, values in samples.items() if values}


@contextlib.contextmanager
def seed_context() -> Iterator[Optional[object]]:
    """The seed's reusable pool context, when the seeds are there."""
    if not os.path.isdir(SEEDS):
        yield None
        return
    sys.path.insert(0, SEEDS)
    import reusable_pool_context as seed

    with torch.multiprocessing.Pool(2) as mp_pool, seed.reusable_pool_context(mp_pool) as ctx:
        twenty(multiprocessing_context=ctx)  # warm
        yield ctx


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--spawn-reps", type=int, default=1)
    parser.add_argument("--batches", type=int, default=30)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, medians of {args.reps} runs "
        f"(torch spawn: {args.spawn_reps})"
    )
    pool = tether.Pool(2, preload=["torch"])
    ctx = pool.context()
    twenty(multiprocessing_context=ctx)  # warm: workers up, torch imported
    with seed_context() as seed:
        loaders: Dict[str, Callable[[], float]] = {
            "torch fork": lambda: twenty(multiprocessing_context="fork"),
            "torch fork, persistent_workers": lambda: twenty(
                multiprocessing_context="fork", persistent_workers=True
            ),
        }
        if seed is not None:
            loaders["seed reusable_pool_context"] = lambda: twenty(multiprocessing_context=seed)
        loaders["tether.Pool"] = lambda: twenty(multiprocessing_context=ctx)
        scenario = interleaved(loaders, args.reps)
        if args.spawn_reps:
            spawn = interleaved(
                {"torch spawn": lambda: twenty(multiprocessing_context="spawn")}, args.spawn_reps
            )
            scenario = {**spawn, **scenario}
        firsts: Dict[str, Callable[[], float]] = {
            "torch fork": lambda: first_batch(multiprocessing_context="fork") * 1000,
        }
        if seed is not None:
            firsts["seed reusable_pool_context"] = lambda: (
                first_batch(multiprocessing_context=seed) * 1000
            )
        firsts["tether.Pool"] = lambda: first_batch(multiprocessing_context=ctx) * 1000
        first = interleaved(firsts, max(args.reps, 5))
    print_versus(
        "20 DataLoaders (64 items, batch 16, 2 workers), one after the other",
        "seconds",
        scenario,
        True,
        digits=3,
    )
    print_versus("Time to the first batch of a new loader", "ms", first, True)
    rates = interleaved(
        {
            "torch fork": lambda: throughput(args.batches, multiprocessing_context="fork"),
            "tether.Pool": lambda: throughput(args.batches, multiprocessing_context=ctx),
        },
        max(args.reps, 5),
    )
    print_versus(
        "Steady state: batches of 32 x 3x224x224 float32, 2 workers", "batches/s", rates, False
    )
    pool.shutdown()


if __name__ == "__main__":
    main()
