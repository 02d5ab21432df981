"""tether.Pool as an Executor, and tether.ProcessPoolExecutor over it, against
concurrent.futures' ProcessPoolExecutor (fork) and loky's reusable executor, 2 workers
each, in the same run.

    python bench/executor.py [--reps N] [--calls N] [--items N]

1. Round trip: ``submit(noop, 1).result()`` one after the other, with the machine otherwise
   idle, then again with a busy-looping process on every core.
2. ``list(map(noop, range(items), chunksize=1))``, tasks per second.

Each figure is the median of ``--reps`` runs; the executors take turns within each
repetition, so that a busy moment of the machine hits them alike. Ratios are against
tether."""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import statistics
import time
from typing import Any, Callable, Dict, List

from _table import busy_cores, print_versus

import tether


def noop(x: Any = None) -> Any:
    return x


def round_trip(executor: concurrent.futures.Executor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        executor.submit(noop, 1).result()
    return (time.perf_counter() - start) / calls


def map_rate(executor: concurrent.futures.Executor, items: int) -> float:
    start = time.perf_counter()
    count = sum(1 for _ in executor.map(noop, range(items), chunksize=1))
    assert count == items
    return items / (time.perf_counter() - start)


def measure(
    makers: Dict[str, Callable[[], concurrent.futures.Executor]],
    reps: int,
    fn: Callable[[concurrent.futures.Executor], float],
) -> Dict[str, float]:
    """Median of ``fn(executor)`` per executor, the executors taking turns."""
    executors = {name: make() for name, make in makers.items()}
    try:
        for executor in executors.values():
            list(executor.map(noop, range(200)))  # warm
        samples: Dict[str, List[float]] = {name: [] for name in makers}
        for _ in range(reps):
            for name, executor in executors.items():
                samples[name].append(fn(executor))
    finally:
        for executor in executors.values():
            executor.shutdown(wait=True)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--items", type=int, default=100_000)
    args = parser.parse_args()
    import loky

    makers: Dict[str, Callable[[], concurrent.futures.Executor]] = {
        "concurrent.futures (fork)": lambda: concurrent.futures.ProcessPoolExecutor(
            2, mp_context=multiprocessing.get_context("fork")
        ),
        "loky reusable executor": lambda: loky.get_reusable_executor(max_workers=2),
        "tether.Pool": lambda: tether.Pool(2),
        "tether.ProcessPoolExecutor": lambda: tether.ProcessPoolExecutor(2),
    }
    print(f"{os.cpu_count()} CPUs, 2 workers each, medians of {args.reps} runs")
    idle = measure(makers, args.reps, lambda e: round_trip(e, args.calls))
    print_versus(
        "Round trip, machine otherwise idle", "us", {k: v * 1e6 for k, v in idle.items()}, True
    )
    with busy_cores():
        busy = measure(makers, args.reps, lambda e: round_trip(e, max(200, args.calls // 10)))
    print_versus(
        "Round trip, a busy-looping process on every core",
        "us",
        {k: v * 1e6 for k, v in busy.items()},
        True,
    )
    rates = measure(makers, args.reps, lambda e: map_rate(e, args.items))
    print_versus(f"map(noop, range({args.items}), chunksize=1)", "tasks/s", rates, False)


if __name__ == "__main__":
    main()
