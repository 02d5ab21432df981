"""Launcher overhead: wall time of ``tether run`` against ``torchrun`` for the same program.

Both start N ranks of ``python -c pass`` on one node and exit; the time is from starting
the launcher to its exit. The two run alternately, in the same run, for several
repetitions; the table shows the medians and their ratio.

    python bench/launcher.py [--reps 5] [--nproc 4] [--tether PATH] [--torchrun PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def find_tether() -> str:
    for candidate in (
        os.environ.get("TETHER_BIN"),
        ROOT / "python" / "tether" / "bin" / "tether",
        ROOT / "target" / "release" / "tether",
    ):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    sys.exit("no tether binary: set TETHER_BIN or build with `cargo build --release -p tether-cli`")


def find_torchrun() -> str:
    beside = Path(sys.executable).with_name("torchrun")
    found = str(beside) if beside.is_file() else shutil.which("torchrun")
    if not found:
        sys.exit("torchrun not found (install torch in this interpreter's environment)")
    return found


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(
        argv, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{argv[0]} failed ({proc.returncode}):\n{proc.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each (default 5)")
    parser.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--tether", default=None, help="path of the tether binary")
    parser.add_argument("--torchrun", default=None, help="path of torchrun")
    args = parser.parse_args()

    program = [sys.executable, "-c", "pass"]
    n = str(args.nproc)
    commands = {
        "tether run": [
            args.tether or find_tether(),
            "run",
            "--standalone",
            "-n",
            n,
            "--",
            *program,
        ],
        "torchrun": [
            args.torchrun or find_torchrun(),
            "--standalone",
            "--nproc-per-node",
            n,
            "--no-python",
            *program,
        ],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.reps):
        for name, argv in commands.items():
            times[name].append(timed(argv))

    print(f"{args.nproc} ranks of `python -c pass`, {args.reps} repetitions each")
    print(f"{'launcher':<12} {'median s':>10} {'min s':>10} {'max s':>10}")
    for name, values in times.items():
        print(
            f"{name:<12} {statistics.median(values):>10.3f} {min(values):>10.3f}"
            f" {max(values):>10.3f}"
        )
    ratio = statistics.median(times["torchrun"]) / statistics.median(times["tether run"])
    print(f"tether run is {ratio:.1f}x faster than torchrun (median wall time)")


if __name__ == "__main__":
    main()
