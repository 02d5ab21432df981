"""DataLoaders on tether.Pool against torch's own workers and the seed's pool context.

    python bench/loaders.py [--reps N] [--spawn-reps N]

1. Twenty DataLoaders (64 small items, batch 16, 2 workers) iterated one after the other:
   torch fork, torch spawn, torch fork with persistent_workers, the seed's
   ``reusable_pool_context`` over a ``torch.multiprocessing.Pool``, and ``tether.Pool``.
   The pools are made (and warmed with one loader) before the clock starts.
2. Time to the first batch of a new loader.
3. Steady-state throughput of one loader of 32 x 3x224x224 float batches (torch fork vs
   tether).
Medians over repetitions; ratios are against tether."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
from torch.utils.data import DataLoader, Dataset

import tether

SEEDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "seeds")
sys.path.insert(0, os.path.normpath(SEEDS))
sys.path.insert(0, "/work/shared/seeds")


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


def twenty(**kwargs) -> None:
    for _ in range(20):
        for _batch in DataLoader(Small(), batch_size=16, num_workers=2, **kwargs):
            pass


def timed(fn: Callable[[], None], reps: int) -> float:
    runs = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


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


def table(title: str, unit: str, rows: Dict[str, float], ours: str, lower_is_better: bool) -> None:
    print(f"\n{title}")
    print(f"  {'':34} {unit:>12} {'vs tether':>10}")
    for name, value in rows.items():
        ratio = value / rows[ours] if lower_is_better else rows[ours] / value
        print(f"  {name:34} {value:12.3f} {ratio:9.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--spawn-reps", type=int, default=1)
    parser.add_argument("--batches", type=int, default=30)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, medians of {args.reps} runs "
        f"(torch spawn: {args.spawn_reps})"
    )

    import reusable_pool_context as seed

    pool = tether.Pool(2, preload=["torch"])
    ctx = pool.context()
    twenty(multiprocessing_context=ctx)  # warm: workers up, torch imported

    scenario: Dict[str, float] = {}
    scenario["torch fork"] = timed(lambda: twenty(multiprocessing_context="fork"), args.reps)
    scenario["torch spawn"] = timed(
        lambda: twenty(multiprocessing_context="spawn"), args.spawn_reps
    )
    scenario["torch fork, persistent_workers"] = timed(
        lambda: twenty(multiprocessing_context="fork", persistent_workers=True), args.reps
    )
    with torch.multiprocessing.Pool(2) as mp_pool, seed.reusable_pool_context(mp_pool) as sctx:
        twenty(multiprocessing_context=sctx)
        scenario["seed reusable_pool_context"] = timed(
            lambda: twenty(multiprocessing_context=sctx), args.reps
        )
        seed_first = statistics.median(first_batch(multiprocessing_context=sctx) for _ in range(5))
    scenario["tether.Pool"] = timed(lambda: twenty(multiprocessing_context=ctx), max(args.reps, 5))
    table(
        "20 DataLoaders (64 items, batch 16, 2 workers), one after the other",
        "seconds",
        scenario,
        "tether.Pool",
        True,
    )

    first = {
        "torch fork": statistics.median(
            first_batch(multiprocessing_context="fork") for _ in range(5)
        ),
        "seed reusable_pool_context": seed_first,
        "tether.Pool": statistics.median(
            first_batch(multiprocessing_context=ctx) for _ in range(5)
        ),
    }
    table(
        "Time to the first batch of a new loader",
        "ms",
        {k: v * 1000 for k, v in first.items()},
        "tether.Pool",
        True,
    )

    # Interleaved, so that a busy moment of the machine hits both alike.
    samples: Dict[str, List[float]] = {"torch fork": [], "tether.Pool": []}
    for _ in range(max(args.reps, 5)):
        samples["torch fork"].append(throughput(args.batches, multiprocessing_context="fork"))
        samples["tether.Pool"].append(throughput(args.batches, multiprocessing_context=ctx))
    rates = {name: statistics.median(values) for name, values in samples.items()}
    table(
        "Steady state: batches of 32 x 3x224x224 float32, 2 workers",
        "batches/s",
        rates,
        "tether.Pool",
        False,
    )
    pool.shutdown()


if __name__ == "__main__":
    main()
