"""What the watch of ``tether run`` costs a training step: the same gloo job on CPU, run with
the watch (the default) and with ``--no-watch``, in turn.

    python bench/watch.py [--reps 7] [--ranks 2] [--steps 250] [--step-ms 20]

Each rank does ``--steps`` steps of CPU work (matrix products on one thread, as many as
take ``--step-ms`` here, counted once before the runs) and an ``all_reduce``; rank 0 times
the steps after a warm-up (wall time, and its main thread's CPU time, which other programs
on a busy machine hardly change) and writes the medians. The two kinds of run alternate,
``--reps`` times each; printed: the median of each and their ratio (target: the watch costs
at most 1%). Then, for a job whose ranks mostly wait (as a hung one does), the CPU time per
second that rank 0 and the launcher use with the watch and without it: what the watch costs
in CPU time, whatever else the machine runs."""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _table import print_table

JOB = textwrap.dedent(
    """
    import os, statistics, sys, time
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    steps, n, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    a = torch.rand(192, 192)
    t = torch.ones(1024)
    times, cpu = [], []
    for step in range(steps + 20):
        start, start_cpu = time.perf_counter(), time.thread_time()
        for _ in range(n):
            a = torch.tanh(a @ a)
        dist.all_reduce(t)
        times.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
    if dist.get_rank() == 0:
        medians = (statistics.median(times[20:]), statistics.median(cpu[20:]))
        open(out, "w").write(repr(medians))
    dist.destroy_process_group()
    """
)


#: A job whose ranks mostly wait (a nap of 50 ms and an all_reduce per step): rank 0 writes
#: the CPU time it and its parent (the launcher's supervisor) used over ``SECONDS``.
IDLE = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    seconds, out = float(sys.argv[1]), sys.argv[2]
    tick = os.sysconf("SC_CLK_TCK")

    def parent_cpu():
        with open(f"/proc/{os.getppid()}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    t = torch.ones(16)
    dist.all_reduce(t)
    start, cpu, launcher = time.monotonic(), time.process_time(), parent_cpu()
    while time.monotonic() - start < seconds:
        time.sleep(0.05)
        dist.all_reduce(t)
    took = time.monotonic() - start
    used = (time.process_time() - cpu, parent_cpu() - launcher)
    if dist.get_rank() == 0:
        open(out, "w").write(repr((used[0] / took, used[1] / took)))
    dist.destroy_process_group()
    """
)

CALIBRATE = textwrap.dedent(
    """
    import sys, time
    import torch
    torch.set_num_threads(1)
    a = torch.rand(192, 192)
    for _ in range(20):
        a = torch.tanh(a @ a)
    start = time.perf_counter()
    for _ in range(200):
        a = torch.tanh(a @ a)
    print(int(float(sys.argv[1]) / 1000 / ((time.perf_counter() - start) / 200)))
    """
)


def products(step_ms: float) -> int:
    """How many products make a step of ``step_ms`` on this machine (one thread)."""
    command = [sys.executable, "-c", CALIBRATE, str(step_ms)]
    return max(1, int(subprocess.run(command, check=True, capture_output=True, text=True).stdout))


def run(args: argparse.Namespace, script: Path, out: Path, watch: bool) -> Tuple[float, float]:
    tether = str(Path(sys.executable).with_name("tether"))
    flags = [] if watch else ["--no-watch"]
    command = [tether, "run", "-n", str(args.ranks), *flags, str(script),
               str(args.steps), str(args.products), str(out)]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=600)
    wall, cpu = ast.literal_eval(out.read_text())
    return float(wall), float(cpu)


def idle(args: argparse.Namespace, tmp: Path) -> None:
    """The CPU time per second the watch takes from a rank and from the launcher."""
    tether = str(Path(sys.executable).with_name("tether"))
    script, out = tmp / "idle.py", tmp / "idle"
    script.write_text(IDLE)
    used: Dict[bool, List[Tuple[float, float]]] = {True: [], False: []}
    for _ in range(3):
        for watch in (False, True):
            flags = [] if watch else ["--no-watch"]
            command = [tether, "run", "-n", str(args.ranks), *flags, str(script), "10", str(out)]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=600)
            rank, launcher = ast.literal_eval(out.read_text())
            used[watch].append((float(rank), float(launcher)))
    rows = []
    for i, what in ((0, "rank 0"), (1, "the launcher")):
        off = statistics.median(u[i] for u in used[False])
        on = statistics.median(u[i] for u in used[True])
        rows.append((what, (f"{off * 1e3:.2f}", f"{on * 1e3:.2f}", f"{(on - off) * 1e3:+.2f}")))
    title = f"CPU ms per second, {args.ranks} waiting ranks, median of 3"
    print_table(title, ["--no-watch", "watch", "the watch's"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--step-ms", type=float, default=20.0)
    args = parser.parse_args()
    args.products = products(args.step_ms)
    times: Dict[bool, List[Tuple[float, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        script, out = Path(tmp) / "job.py", Path(tmp) / "step"
        script.write_text(JOB)
        for _ in range(args.reps):
            for watch in (False, True):
                times[watch].append(run(args, script, out, watch))
        idle(args, Path(tmp))
    rows = []
    medians = {}
    for watch, label in ((False, "--no-watch"), (True, "watch (default)")):
        for i, what in ((0, "wall"), (1, "main thread's CPU")):
            runs = [t[i] for t in times[watch]]
            medians[watch, i] = statistics.median(runs)
            shown = " ".join(f"{t * 1e3:.1f}" for t in runs)
            rows.append((f"{label}, {what}", (f"{medians[watch, i] * 1e3:.2f}", shown)))
    title = f"step time, {args.ranks} ranks, {args.products} products, {args.reps} runs"
    print_table(title, ["median ms", "runs (ms)"], rows)
    for i, what in ((0, "wall"), (1, "CPU")):
        ratio = medians[True, i] / medians[False, i]
        print(f"watch / no watch ({what}): {ratio:.3f} ({(ratio - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
