"""What the watch of ``tether run`` costs a training step: the same gloo job on CPU, run with
the watch (the default) and with ``--no-watch``, in turn.

    python bench/watch.py [--reps 5] [--ranks 2] [--steps 150] [--step-ms 20]

Each rank does ``--steps`` steps of CPU work (matrix products on one thread, about
``--step-ms`` each) and an ``all_reduce``; rank 0 times the steps after a warm-up and
writes the median. The two kinds of run alternate, ``--reps`` times each; printed: the
median step time of each and their ratio (target: the watch costs at most 1%)."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _table import print_table

JOB = textwrap.dedent(
    """
    import os, statistics, sys, time
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    steps, step_ms, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    a = torch.rand(192, 192)
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < step_ms / 1000:
        a = torch.tanh(a @ a)
        n += 1
    t = torch.ones(1024)
    times = []
    for step in range(steps + 20):
        start = time.perf_counter()
        for _ in range(n):
            a = torch.tanh(a @ a)
        dist.all_reduce(t)
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        open(out, "w").write(repr(statistics.median(times[20:])))
    dist.destroy_process_group()
    """
)


def run(args: argparse.Namespace, script: Path, out: Path, watch: bool) -> float:
    tether = str(Path(sys.executable).with_name("tether"))
    flags = [] if watch else ["--no-watch"]
    command = [tether, "run", "-n", str(args.ranks), *flags, str(script),
               str(args.steps), str(args.step_ms), str(out)]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=600)
    return float(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--step-ms", type=float, default=20.0)
    args = parser.parse_args()
    times: Dict[bool, List[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        script, out = Path(tmp) / "job.py", Path(tmp) / "step"
        script.write_text(JOB)
        for _ in range(args.reps):
            for watch in (False, True):
                times[watch].append(run(args, script, out, watch))
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print_table(
        f"step time, {args.ranks} ranks, median of {args.reps} runs",
        ["median ms", "runs (ms)"],
        [
            ("--no-watch", (f"{off * 1e3:.2f}", " ".join(f"{t * 1e3:.1f}" for t in times[False]))),
            (
                "watch (default)",
                (f"{on * 1e3:.2f}", " ".join(f"{t * 1e3:.1f}" for t in times[True])),
            ),
        ],
    )
    print(f"\nwatch / no watch: {on / off:.3f} (the watch's cost: {(on / off - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
