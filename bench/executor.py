"""tether.Pool as an Executor against concurrent.futures' ProcessPoolExecutor (fork) and
loky's reusable executor, 2 workers each.

    python bench/executor.py [--reps N]

Round trip: ``submit(noop).result()`` one after the other; map:
``list(map(fn, range(20000), chunksize=1))``. Medians over repetitions."""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import statistics
import time
from typing import Any, Callable, Dict

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
    out = list(executor.map(noop, range(items), chunksize=1))
    assert len(out) == items
    return items / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--items", type=int, default=20000)
    args = parser.parse_args()
    import loky

    makers: Dict[str, Callable[[], concurrent.futures.Executor]] = {
        "concurrent.futures (fork)": lambda: concurrent.futures.ProcessPoolExecutor(
            2, mp_context=multiprocessing.get_context("fork")
        ),
        "loky reusable executor": lambda: loky.get_reusable_executor(max_workers=2),
        "tether.Pool": lambda: tether.Pool(2),
    }
    rt: Dict[str, float] = {}
    rate: Dict[str, float] = {}
    for name, make in makers.items():
        executor = make()
        list(executor.map(noop, range(200)))  # warm
        rt[name] = statistics.median(round_trip(executor, args.calls) for _ in range(args.reps))
        rate[name] = statistics.median(map_rate(executor, args.items) for _ in range(args.reps))
        executor.shutdown(wait=True)
    print(f"{os.cpu_count()} CPUs, 2 workers, medians of {args.reps} runs")
    print(
        f"\n  {'':28} {'round trip us':>14} {'vs tether':>10} {'map tasks/s':>12} {'vs tether':>10}"
    )
    for name in makers:
        print(
            f"  {name:28} {rt[name] * 1e6:14.1f} {rt[name] / rt['tether.Pool']:9.1f}x "
            f"{rate[name]:12.0f} {rate['tether.Pool'] / rate[name]:9.1f}x"
        )


if __name__ == "__main__":
    main()
