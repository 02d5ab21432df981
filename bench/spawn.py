"""tether.spawn against torch.multiprocessing.spawn, from a script that imports torch (so
each spawned child imports torch too, as in real training scripts).

    python bench/spawn.py [--reps 3] [--nprocs 2 4 8]

Prints, per nprocs, the median wall time from the call to a successful join for each, and the
ratio; then the latency from a child's exception to the parent's raise."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch  # noqa: F401  (what a training script has imported when it spawns)
import torch.multiprocessing as tmp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _table import fmt_seconds, median, print_table, ratio, repeat  # noqa: E402

import tether  # noqa: E402


def trivial(i: int) -> None:
    pass


def raise_now(i: int) -> None:
    raise ValueError(repr(time.monotonic()))


def time_spawn(spawn, nprocs: int) -> float:
    start = time.perf_counter()
    spawn(trivial, nprocs=nprocs)
    return time.perf_counter() - start


def time_failure(spawn, errors) -> float:
    """Seconds from the child's raise to the parent's raise."""
    try:
        spawn(raise_now, nprocs=1)
    except errors as e:
        caught = time.monotonic()
        raised = float(str(e).strip().rsplit("ValueError: ", 1)[1])
        return caught - raised
    raise AssertionError("the child did not fail")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--nprocs", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {args.reps} repetitions")

    rows = []
    for n in args.nprocs:
        theirs = median(repeat(lambda n=n: time_spawn(tmp.spawn, n), args.reps))
        ours = median(repeat(lambda n=n: time_spawn(tether.spawn, n), args.reps))
        rows.append((f"nprocs={n}", [fmt_seconds(theirs), fmt_seconds(ours), ratio(theirs, ours)]))
        print(f"  nprocs={n}: torch {fmt_seconds(theirs)}, tether {fmt_seconds(ours)}", flush=True)
    print_table("spawn to join (median)", ["torch.mp.spawn", "tether.spawn", "speed-up"], rows)

    theirs = median(repeat(lambda: time_failure(tmp.spawn, tmp.ProcessRaisedException), args.reps))
    ours = median(
        repeat(lambda: time_failure(tether.spawn, tether.ProcessRaisedException), args.reps)
    )
    print_table(
        "child raise -> parent raise (median)",
        ["torch.mp.spawn", "tether.spawn", "speed-up"],
        [("nprocs=1", [fmt_seconds(theirs), fmt_seconds(ours), ratio(theirs, ours)])],
    )


if __name__ == "__main__":
    main()
