"""The launchers on a real training script's start (for ``launcher.py``): each rank imports
torch and ``torch.distributed``, joins a gloo process group and passes a barrier, then writes
the time it did. Measured, ``tether run`` against ``torchrun`` with the same arguments:

- start: from starting the launcher to every rank past its barrier (N ranks, one node);
- restart (``tether run`` only, ``--max-restarts 1``): from a rank's failure (2 s after the
  barrier it writes the time, then exits 1) to every rank of the next attempt past its
  barrier. (torchrun's own restart of this one-node form fails with torch 2.15: the
  figure to beat is torchrun's start.);
- memory: the summed PSS of 4 idle ranks once they have imported torch (and, for tether,
  the zygote's own PSS beside it);
- two nodes: two launchers as two nodes of one job on this machine, c10d on 127.0.0.1, 2
  ranks each: from starting both to every rank past its barrier.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

#: A rank: ``rank.py MARKS MODE``; MODE is ``start``, ``restart`` or ``idle``.
RANK = """
import os, sys, time
from pathlib import Path
marks, mode = Path(sys.argv[1]), sys.argv[2]
attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
import torch
if mode == "idle":
    (marks / f"ready-{rank}").write_text(str(os.getpid()))
    time.sleep(600)
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
(marks / f"past-{attempt}-{rank}").write_text(repr(time.time()))
if mode == "restart" and attempt == "0":
    if rank == "1":
        time.sleep(2)  # it trains a little while
        (marks / "failed").write_text(repr(time.time()))
        sys.exit(1)
    time.sleep(600)
dist.destroy_process_group()
"""

ENV = dict(os.environ, GLOO_SOCKET_IFNAME="lo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fresh(marks: Path) -> None:
    shutil.rmtree(marks, ignore_errors=True)
    marks.mkdir()


def _finish(procs: List[subprocess.Popen], argv: List[str]) -> None:
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(argv)} failed ({proc.returncode}):\n{err}")


def _past(marks: Path, attempt: int, ranks: int) -> float:
    return max(float((marks / f"past-{attempt}-{r}").read_text()) for r in range(ranks))


def start(launcher: List[str], script: str, marks: Path, nproc: int) -> float:
    """Seconds from starting the launcher to every rank past its barrier."""
    _fresh(marks)
    argv = [*launcher, "--standalone", "--nproc-per-node", str(nproc), script, str(marks), "start"]
    began = time.time()
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV
    )
    _finish([proc], argv)
    return _past(marks, 0, nproc) - began


def restart(launcher: List[str], script: str, marks: Path, nproc: int) -> float:
    """Seconds from a rank's failure to every rank of the next attempt past its barrier."""
    _fresh(marks)
    argv = [*launcher, "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "1"]
    argv += [script, str(marks), "restart"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV
    )
    _finish([proc], argv)
    return _past(marks, 1, nproc) - float((marks / "failed").read_text())


def pss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    return 0.0


def descendants(pid: int) -> List[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                found += [int(child), *descendants(int(child))]
    return found


def idle(launcher: List[str], script: str, marks: Path, nproc: int) -> Tuple[float, float]:
    """The summed PSS (MiB) of ``nproc`` idle ranks that imported torch, and that of the
    launcher's zygote (0 for none)."""
    _fresh(marks)
    argv = [*launcher, "--standalone", "--nproc-per-node", str(nproc), script, str(marks), "idle"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    try:
        deadline = time.monotonic() + 300
        ready = [marks / f"ready-{r}" for r in range(nproc)]
        while not all(p.exists() for p in ready):
            if time.monotonic() > deadline or proc.poll() is not None:
                sys.exit(f"{' '.join(argv)}: the ranks did not get ready")
            time.sleep(0.05)
        time.sleep(1.0)
        ranks = sum(pss_mib(int(p.read_text())) for p in ready)
        zygotes = [p for p in descendants(proc.pid) if _comm(p) == "tether-zygote"]
        return ranks, sum(pss_mib(p) for p in zygotes)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def two_nodes(launcher: List[str], script: str, marks: Path) -> float:
    """Seconds from starting two launchers (two nodes of 2 ranks) to every rank past its
    barrier."""
    _fresh(marks)
    argv = [*launcher, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    argv += ["--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "bench-real"]
    argv += [script, str(marks), "start"]
    began = time.time()
    procs = [
        subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV
        )
        for _ in range(2)
    ]
    _finish(procs, argv)
    return _past(marks, 0, 4) - began


def measure(
    launchers: Dict[str, List[str]], reps: int, tmp: str
) -> Dict[str, Dict[str, List[float]]]:
    """Every measure, by launcher, ``reps`` times, the launchers taking turns."""
    script = os.path.join(tmp, "rank.py")
    Path(script).write_text(RANK)
    marks = Path(tmp, "real-marks")
    ours = "tether run"
    times: Dict[str, Dict[str, List[float]]] = {}

    def add(what: str, name: str, value: float) -> None:
        times.setdefault(what, {}).setdefault(name, []).append(value)

    for _ in range(reps):
        for name, launcher in launchers.items():
            for nproc in (4, 8):
                add(f"start, {nproc} ranks (s)", name, start(launcher, script, marks, nproc))
            ranks, zygote = idle(launcher, script, marks, 4)
            add("PSS of 4 idle ranks (MiB)", name, ranks)
            if name == ours:
                add("PSS of the zygote (MiB)", name, zygote)
                add("restart, 4 ranks (s)", name, restart(launcher, script, marks, 4))
            add("two nodes x 2 ranks, start (s)", name, two_nodes(launcher, script, marks))
    return times
