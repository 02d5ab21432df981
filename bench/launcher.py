"""Launcher overhead: ``tether run`` against ``torchrun`` for the same programs.

First a real training script's start (``_real_script``): each rank imports torch and
``torch.distributed``, joins a gloo group and passes a barrier. Timed with the same arguments
for both launchers: launch to every rank past its barrier (4 and 8 ranks), ``tether run``'s
restart (a rank's failure to every rank of the next attempt past the barrier), the summed
PSS of 4 idle ranks after ``import torch``, and two launchers as two nodes (c10d) of 2 ranks
each.

Then N ranks of an empty Python script on one node, from starting the launcher to its exit,
in two forms with the very same arguments for both launchers:

- torchrun's own form: ``LAUNCHER --standalone --nproc-per-node N empty.py``;
- a command with ``--no-python``: ``LAUNCHER --standalone --nproc-per-node N --no-python
  PYTHON -c pass``.

``tether`` is the console script installed beside this interpreter (what users run), and
the launchers run alternately, in the same run, for several repetitions; the tables show
the medians and their ratio.

Then two launchers act as two nodes of one job on this machine, each with 2 ranks, in
torchrun's c10d form (``--nnodes 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT``,
no ``--node-rank``), the same command line for both launchers, with a script that imports
nothing:

- start: from starting both launchers to every rank running (each rank writes the time it
  started);
- restart: from a rank's failure (it writes the time, then exits 1) to every node's ranks
  running again in the new round (``--max-restarts 1``).

Beside them, the floor of any start through torch's own rendezvous: two interpreters (one
per node) importing torch's rendezvous handler at once, as both launchers' first step does.

    python bench/launcher.py [--reps 5] [--nproc 4] [--tether PATH] [--torchrun PATH]
                             [--skip-real] [--skip-one-node] [--skip-two-nodes]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _real_script

#: A rank of the two-node job: it writes when it started; in the first round, local rank 0
#: of node rank 1 writes when it fails and fails; the other ranks wait to be stopped; in the
#: round after the failure every rank ends at once.
TWO_NODE_RANK = """
import os, sys, time
from pathlib import Path
now = time.time()
marks = Path(sys.argv[1])
failed = (marks / "failed").exists()
(marks / f"start-{int(failed)}-{os.environ['RANK']}").write_text(repr(now))
if failed:
    sys.exit(0)
if sys.argv[2] == "restart" and os.environ["GROUP_RANK"] == "1" and os.environ["LOCAL_RANK"] == "0":
    time.sleep(0.5)
    (marks / "failed").write_text(repr(time.time()))
    sys.exit(1)
if sys.argv[2] == "restart":
    time.sleep(120)
"""


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def two_nodes(launcher: List[str], script: str, marks: Path, what: str) -> float:
    """One two-node job; returns the seconds `what` ("start" or "restart") took."""
    shutil.rmtree(marks, ignore_errors=True)
    marks.mkdir()
    argv = [
        *launcher,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        "bench",
        "--max-restarts",
        "1",
        script,
        str(marks),
        what,
    ]
    began = time.time()
    nodes = [
        subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    errors = [node.communicate(timeout=600)[1] for node in nodes]
    for node, err in zip(nodes, errors):
        if node.returncode != 0:
            sys.exit(f"{' '.join(argv)} failed ({node.returncode}):\n{err}")
    if what == "start":
        starts = [float(marks.joinpath(f"start-0-{rank}").read_text()) for rank in range(4)]
        return max(starts) - began
    failed = float(marks.joinpath("failed").read_text())
    return max(float(marks.joinpath(f"start-1-{rank}").read_text()) for rank in range(4)) - failed


#: What a node imports before it can join torch's rendezvous (both launchers do).
RENDEZVOUS_IMPORT = (
    "import torch.distributed.elastic.rendezvous.dynamic_rendezvous, "
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend"
)


def import_floor() -> float:
    """Seconds for two interpreters, started at once, to import torch's rendezvous."""
    began = time.time()
    argv = [sys.executable, "-c", RENDEZVOUS_IMPORT]
    procs = [subprocess.Popen(argv) for _ in range(2)]
    if any(proc.wait(timeout=600) != 0 for proc in procs):
        sys.exit("importing torch's rendezvous failed")
    return time.time() - began


def bench_two_nodes(launchers: Dict[str, List[str]], reps: int, tmp: str) -> None:
    script = os.path.join(tmp, "rank.py")
    Path(script).write_text(TWO_NODE_RANK)
    marks = Path(tmp, "marks")
    times = {what: {name: [] for name in launchers} for what in ("start", "restart")}
    floor: List[float] = []
    for _ in range(reps):
        for what, by_launcher in times.items():
            for name, launcher in launchers.items():
                by_launcher[name].append(two_nodes(launcher, script, marks, what))
        floor.append(import_floor())
    print(f"\ntwo nodes x 2 ranks, c10d on 127.0.0.1, {reps} repetitions each")
    print(f"{'measure':<12} {'launcher':<12} {'median s':>10} {'min s':>10} {'max s':>10}")
    for what, by_launcher in times.items():
        for name, values in by_launcher.items():
            print(
                f"{what:<12} {name:<12} {statistics.median(values):>10.3f}"
                f" {min(values):>10.3f} {max(values):>10.3f}"
            )
    for what, by_launcher in times.items():
        ours, theirs = (statistics.median(by_launcher[n]) for n in ("tether run", "torchrun"))
        print(f"{what}: tether run takes {ours / theirs:.2f}x torchrun's time (median)")
    print(
        f"floor of a start: two nodes' import of torch's rendezvous takes "
        f"{statistics.median(floor):.3f} s (median; min {min(floor):.3f}, max {max(floor):.3f}),"
        f" {statistics.median(floor) / statistics.median(times['start']['torchrun']):.2f}x"
        " torchrun's start"
    )


#: The targets of the real script's figures: tether run's median at most this share of
#: torchrun's (the restart: of torchrun's start of 4 ranks).
TARGETS = {
    "start, 4 ranks (s)": 0.5,
    "start, 8 ranks (s)": 0.35,
    "restart, 4 ranks (s)": 0.1,
    "PSS of 4 idle ranks (MiB)": 0.5,
    "two nodes x 2 ranks, start (s)": 0.5,
}


def bench_real(launchers: Dict[str, List[str]], reps: int, tmp: str) -> None:
    times = _real_script.measure(launchers, reps, tmp)
    print(
        f"\na real script (import torch and torch.distributed, a gloo group, a barrier), "
        f"{reps} repetitions each"
    )
    print(f"{'measure':<32} {'launcher':<12} {'median':>10} {'min':>10} {'max':>10}")
    for what, by_launcher in times.items():
        for name, values in by_launcher.items():
            print(
                f"{what:<32} {name:<12} {statistics.median(values):>10.3f}"
                f" {min(values):>10.3f} {max(values):>10.3f}"
            )
    for what, target in TARGETS.items():
        ours = statistics.median(times[what]["tether run"])
        reference = "start, 4 ranks (s)" if what.startswith("restart") else what
        theirs = statistics.median(times[reference]["torchrun"])
        print(
            f"{what}: tether run {ours / theirs:.2f}x torchrun's"
            + (" start" if reference != what else "")
            + f" (target: at most {target}x)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each (default 5)")
    parser.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--tether", default=None, help="the tether command [beside python]")
    parser.add_argument("--torchrun", default=None, help="path of torchrun [beside python]")
    parser.add_argument("--skip-real", action="store_true", help="no real training script")
    parser.add_argument("--skip-one-node", action="store_true", help="only the two-node job")
    parser.add_argument("--skip-two-nodes", action="store_true", help="only one node")
    args = parser.parse_args()
    launchers = {
        "tether run": [args.tether or beside_python("tether"), "run"],
        "torchrun": [args.torchrun or beside_python("torchrun")],
    }
    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        if not args.skip_real:
            bench_real(launchers, args.reps, tmp)
        script = os.path.join(tmp, "empty.py")
        Path(script).write_text("")
        times: Dict[str, Dict[str, List[float]]] = {}
        for form, form_args in forms(args.nproc, script).items():
            if args.skip_one_node:
                break
            times[form] = {name: [] for name in launchers}
            for _ in range(args.reps):
                for name, launcher in launchers.items():
                    times[form][name].append(timed([*launcher, *form_args]))
        if not args.skip_two_nodes:
            bench_two_nodes(launchers, args.reps, tmp)
    if not times:
        return
    print(f"\n{args.nproc} ranks of an empty Python program, {args.reps} repetitions each")
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
