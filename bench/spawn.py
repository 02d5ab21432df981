"""Starting processes from a script that imports torch (so that each fresh child imports
torch too, as a training script's children do): tether against torch, in the same run.

    python bench/spawn.py [--reps 3] [--nprocs 2 4 8]

For each nprocs, the median wall time from the call to a successful join of a trivial
function: torch.multiprocessing.spawn; torch's start_processes with "fork", and with
Python's forkserver and torch preloaded (cold: server started by the call; warm: already
up); tether "spawn"; and tether "forkserver", the zygote (cold: zygote started by the call;
warm: already up). Then warm zygote starts of many ranks (--many, default 8 64 1000) with
the cost per rank; the latency from a child's exception to the parent's raise; and the
summed PSS of 8 idle children, spawn against zygote."""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.forkserver
import os
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.multiprocessing as tmp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _table import fmt_seconds, median, print_table, ratio

import tether
from tether import _native
from tether.zygote import client


def trivial(i: int) -> None:
    pass


def raise_now(i: int) -> None:
    raise ValueError(repr(time.monotonic()))


def idle(i: int, ready, release) -> None:
    ready.put(os.getpid())
    release.wait()


def timed(call: Callable[[], None]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


#: How long a warm start waits after the server's previous start: time for tether's zygote
#: to fork its children ahead again (and, after its own start, to finish collapsing its
#: memory into huge pages), as it would have between two starts of a real program. Python's
#: forkserver gets the same pause.
WARM_PAUSE = 1.5


def stop_python_forkserver() -> None:
    server = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is not None:
        server._stop()


def torch_forkserver(n: int, cold: bool) -> float:
    if cold:
        stop_python_forkserver()
    else:
        time.sleep(WARM_PAUSE)  # the same pause as tether's warm start gets
    multiprocessing.set_forkserver_preload(["torch"])
    return timed(lambda: tmp.start_processes(trivial, nprocs=n, start_method="forkserver"))


def tether_forkserver(n: int, cold: bool) -> float:
    if cold:
        client.shutdown()
    else:
        # Warm: the zygote is up, and has forked ahead the children of a start this size
        # (as many as it keeps).
        tether.start_processes(trivial, nprocs=min(n, _native.MAX_BLANKS))
        time.sleep(WARM_PAUSE)
    return timed(lambda: tether.start_processes(trivial, nprocs=n, start_method="forkserver"))


CONTENDERS: Dict[str, Callable[[int], float]] = {
    "torch spawn": lambda n: timed(lambda: tmp.spawn(trivial, nprocs=n)),
    "torch fork": lambda n: timed(
        lambda: tmp.start_processes(trivial, nprocs=n, start_method="fork")
    ),
    "torch forkserver cold": lambda n: torch_forkserver(n, cold=True),
    "torch forkserver warm": lambda n: torch_forkserver(n, cold=False),
    "tether spawn": lambda n: timed(
        lambda: tether.start_processes(trivial, nprocs=n, start_method="spawn")
    ),
    "tether zygote cold": lambda n: tether_forkserver(n, cold=True),
    "tether zygote warm": lambda n: tether_forkserver(n, cold=False),
}


def failure_latency(spawn, errors) -> float:
    """Seconds from the child's raise to the parent's raise."""
    try:
        spawn(raise_now, nprocs=1)
    except errors as e:
        caught = time.monotonic()
        return caught - float(str(e).strip().rsplit("ValueError: ", 1)[1])
    raise AssertionError("the child did not fail")


def pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def idle_children_pss(method: str, n: int = 8) -> float:
    """The summed PSS (MiB) of ``n`` idle children started with ``method``."""
    mp = multiprocessing.get_context("spawn")
    ready, release = mp.Queue(), mp.Event()
    ctx = tether.start_processes(
        idle, args=(ready, release), nprocs=n, join=False, start_method=method
    )
    pids = [ready.get(timeout=300) for _ in range(n)]
    total = sum(pss_kib(p) for p in pids) / 1024
    release.set()
    ctx.join()
    ready.close()
    ready.join_thread()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--nprocs", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--many", type=int, nargs="+", default=[8, 64, 1000])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {args.reps} repetitions")

    results: Dict[int, Dict[str, float]] = {}
    for n in args.nprocs:
        samples: Dict[str, List[float]] = {name: [] for name in CONTENDERS}
        for _ in range(args.reps):  # interleaved, so that drift hits every contender alike
            for name, run in CONTENDERS.items():
                samples[name].append(run(n))
        results[n] = {name: median(s) for name, s in samples.items()}
        print(
            f"  nprocs={n}: " + ", ".join(f"{k} {fmt_seconds(v)}" for k, v in results[n].items()),
            flush=True,
        )

    names = list(CONTENDERS)
    print_table(
        "start to join (median)",
        [f"nprocs={n}" for n in args.nprocs],
        [(name, [fmt_seconds(results[n][name]) for n in args.nprocs]) for name in names],
    )
    base = "torch spawn"
    print_table(
        f"speed-up over {base}",
        [f"nprocs={n}" for n in args.nprocs],
        [
            (name, [ratio(results[n][base], results[n][name]) for n in args.nprocs])
            for name in names[1:]
        ],
    )

    if 8 in args.nprocs:
        fork8, warm8 = results[8]["torch fork"], results[8]["tether zygote warm"]
        print(f"\nwarm zygote, 8 ranks: {warm8 / fork8:.2f} of torch fork's time (target <= 0.5)")
        cold8, torch_cold8 = results[8]["tether zygote cold"], results[8]["torch forkserver cold"]
        print(f"cold zygote, 8 ranks: {cold8 / torch_cold8:.2f} of torch forkserver's (<= 1)")

    many = {
        n: median([tether_forkserver(n, cold=False) for _ in range(args.reps)]) for n in args.many
    }
    print_table(
        "warm zygote start (median)",
        [f"nprocs={n}" for n in args.many],
        [
            ("start to join", [fmt_seconds(many[n]) for n in args.many]),
            ("per rank", [fmt_seconds(many[n] / n) for n in args.many]),
            (
                "per rank / at 8",
                [f"{many[n] / n / (many[8] / 8):.2f}" if 8 in many else "-" for n in args.many],
            ),
        ],
    )

    theirs = median(
        [failure_latency(tmp.spawn, tmp.ProcessRaisedException) for _ in range(args.reps)]
    )
    ours = median(
        [failure_latency(tether.spawn, tether.ProcessRaisedException) for _ in range(args.reps)]
    )
    print_table(
        "child raise -> parent raise (median)",
        ["torch.mp.spawn", "tether.spawn", "speed-up"],
        [("nprocs=1", [fmt_seconds(theirs), fmt_seconds(ours), ratio(theirs, ours)])],
    )

    spawn_pss = idle_children_pss("spawn")
    zygote_pss = idle_children_pss("forkserver")
    print_table(
        "summed PSS of 8 idle children",
        ["spawn", "zygote", "zygote/spawn"],
        [("MiB", [f"{spawn_pss:.0f}", f"{zygote_pss:.0f}", f"{zygote_pss / spawn_pss:.2f}"])],
    )


if __name__ == "__main__":
    main()
