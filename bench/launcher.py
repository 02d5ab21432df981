"""Launcher overhead: wall time of ``tether run`` against ``torchrun`` for the same program.

Both start N ranks of an empty Python script on one node and exit; the time is from
starting the launcher to its exit. Two forms are timed, each with the very same
arguments for both launchers:

- torchrun's own form: ``LAUNCHER --standalone --nproc-per-node N empty.py``;
- a command with ``--no-python``: ``LAUNCHER --standalone --nproc-per-node N --no-python
  PYTHON -c pass``.

``tether`` is the console script installed beside this interpreter (what users run), and
the launchers run alternately, in the same run, for several repetitions; the table shows
the medians and their ratio.

    python bench/launcher.py [--reps 5] [--nproc 4] [--tether PATH] [--torchrun PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List


def beside_python(name: str) -> str:
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.is_file() else shutil.which(name)
    if not found:
        sys.exit(f"{name} not found (install it in this interpreter's environment)")
    return found


def timed(argv: List[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(
        argv, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr}")
    return elapsed


def forms(nproc: int, script: str) -> Dict[str, List[str]]:
    """The launcher arguments of each form (the same for both launchers)."""
    common = ["--standalone", "--nproc-per-node", str(nproc)]
    return {
        "script": [*common, script],
        "--no-python": [*common, "--no-python", sys.executable, "-c", "pass"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each (default 5)")
    parser.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--tether", default=None, help="the tether command [beside python]")
    parser.add_argument("--torchrun", default=None, help="path of torchrun [beside python]")
    args = parser.parse_args()
    launchers = {
        "tether run": [args.tether or beside_python("tether"), "run"],
        "torchrun": [args.torchrun or beside_python("torchrun")],
    }
    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        script = os.path.join(tmp, "empty.py")
        Path(script).write_text("")
        times: Dict[str, Dict[str, List[float]]] = {}
        for form, form_args in forms(args.nproc, script).items():
            times[form] = {name: [] for name in launchers}
            for _ in range(args.reps):
                for name, launcher in launchers.items():
                    times[form][name].append(timed([*launcher, *form_args]))

    print(f"{args.nproc} ranks of an empty Python program, {args.reps} repetitions each")
    print(f"{'form':<12} {'launcher':<12} {'median s':>10} {'min s':>10} {'max s':>10}")
    for form, by_launcher in times.items():
        for name, values in by_launcher.items():
            print(
                f"{form:<12} {name:<12} {statistics.median(values):>10.3f}"
                f" {min(values):>10.3f} {max(values):>10.3f}"
            )
    for form, by_launcher in times.items():
        ratio = statistics.median(by_launcher["torchrun"]) / statistics.median(
            by_launcher["tether run"]
        )
        print(f"{form}: tether run is {ratio:.1f}x faster than torchrun (median wall time)")


if __name__ == "__main__":
    main()
