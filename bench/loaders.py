"""DataLoaders on tether.Pool against torch's own workers, in the same run.

    python bench/loaders.py [--reps N] [--spawn-reps N] [--batches N] [--no-big] [--steady]
                            [--big-only]

1. Twenty DataLoaders (64 small items, batch 16, 2 workers) iterated one after the other:
   torch fork, torch fork with persistent_workers, torch spawn (``--spawn-reps``, slow),
   the seed's ``reusable_pool_context`` over a ``torch.multiprocessing.Pool`` when it is
   there, and ``tether.Pool``. The pools are made (and warmed with one loader) before the
   clock starts.
2. Time to the first batch of a new loader.
3. Datasets of real size (``--no-big`` leaves them out): an ImageFolder-like list of
   1,281,167 ``(path, class)`` samples (torchvision's ImageFolder over ImageNet's train
   set), a 512 MiB numpy array and a 512 MiB torch tensor, each against torch fork:
   the first batch of a new loader over a dataset the pool has served; the first loader
   over a new dataset object, against one ``ForkingPickler.dumps`` plus one
   ``pickle.loads`` of it; 20 loaders in turn (8 batches of 64 each); the workers' PSS
   after them; before them, the time to start a pool of 2 workers. Each contender runs in
   a process of its own (see ``Contender``).
4. Steady-state throughput of one loader of 32 x 3x224x224 float batches, with the machine
   otherwise idle, then with a busy-looping process on every core (``--steady``: only
   this part).

Each figure is the median over repetitions; within a repetition the contenders take
turns, so that a busy moment of the machine hits them alike. Ratios are against tether."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from _table import busy_cores, print_versus
from torch.utils.data import DataLoader, Dataset

import tether

SEEDS = "/work/shared/seeds"


class Small(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((8,), float(i))


class Images(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.empty(3, 224, 224).fill_(float(i))


class Folder(Dataset):
    """As torchvision's ImageFolder over ImageNet's train set: 1,281,167 (path, class)."""

    def __init__(self, n: int = 1_281_167) -> None:
        self.samples = [
            (f"/data/imagenet/train/n{i // 1300:08d}/n{i // 1300:08d}_{i}.JPEG", i // 1300)
            for i in range(n)
        ]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> int:
        return self.samples[i][1]


class Rows(Dataset):
    """Rows of 1,024 float32 of a 512 MiB array (numpy or torch); item i is row i."""

    def __init__(self, torch_tensor: bool) -> None:
        rows = 512 * 2**20 // 4096
        array = np.ones((rows, 1024), dtype=np.float32)
        self.rows = torch.from_numpy(array) if torch_tensor else array

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:
        row = self.rows[i]
        return row if isinstance(row, torch.Tensor) else torch.from_numpy(row)


#: Section 3's datasets: short name -> (title, maker).
BIG: Dict[str, Tuple[str, Callable[[], Dataset]]] = {
    "folder": ("ImageFolder-like, 1,281,167 samples", Folder),
    "numpy": ("numpy array, 512 MiB", lambda: Rows(torch_tensor=False)),
    "tensor": ("torch tensor, 512 MiB", lambda: Rows(torch_tensor=True)),
}


def first_of(dataset: Dataset, context: Any) -> float:
    """Seconds to the first batch (64, 2 workers) of a new loader over ``dataset``."""
    start = time.perf_counter()
    it = iter(DataLoader(dataset, batch_size=64, num_workers=2, multiprocessing_context=context))
    next(it)
    elapsed = time.perf_counter() - start
    del it
    return elapsed


def dumps_loads(dataset: Dataset) -> float:
    start = time.perf_counter()
    pickle.loads(ForkingPickler.dumps(dataset))
    return time.perf_counter() - start


def pss_kib(pids: List[int]) -> int:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
    return total


def loaders_in_turn(dataset: Dataset, context: Any, count: int = 20) -> Dict[str, float]:
    """``count`` loaders over ``dataset``, 8 batches of 64 each: seconds, and the workers'
    PSS (MiB) measured during the last loader."""
    start = time.perf_counter()
    pss = 0.0
    for n in range(count):
        loader = DataLoader(
            dataset,
            batch_size=64,
            num_workers=2,
            multiprocessing_context=context,
            sampler=range(0, len(dataset), len(dataset) // 512)[:512],
        )
        it = iter(loader)
        for _ in range(8):
            next(it)
        if n == count - 1:
            pss = pss_kib([w.pid for w in it._workers]) / 1024
        del it, loader
    return {"seconds": time.perf_counter() - start, "pss": pss}


def big_datasets(reps: int) -> None:
    """Section 3, one dataset at a time (each is dropped before the next is made), after
    what a new user pays first: starting the pool. Each contender runs in a process of its
    own (``Contender``)."""
    with Contender("fork", "none") as fork, Contender("tether", "none") as ours:
        starts = interleaved(
            {"torch fork Pool(2)": fork.command("start"), "tether.Pool": ours.command("start")},
            reps,
        )
    print_versus("Start a pool of 2 workers (to every worker ready)", "ms", starts, True)
    for name in BIG:
        one_big_dataset(name, reps)


class Contender:
    """One contender of section 3 in a process of its own (``--contender``), which makes the
    dataset once and answers commands (``serve_contender``). A fork loader write-protects
    the whole heap of the process that starts it (copy on write), so that whatever runs
    there next pays a page fault for each page it writes: run in one process, the tether
    loader after a fork loader took about 340 page faults where it takes 16 alone, and 1 ms
    more. In processes of their own, each contender's figures carry only its own costs; the
    contenders still take turns, command by command."""

    def __init__(self, who: str, dataset: str) -> None:
        argv = [sys.executable, os.path.abspath(__file__), "--contender", who, dataset]
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.ask("ready")

    def ask(self, command: str) -> Any:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the contender process {self.process.args} ended")
        return json.loads(line)

    def command(self, command: str) -> Callable[[], Any]:
        return lambda: self.ask(command)

    def __enter__(self) -> "Contender":
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(60)
        finally:
            if self.process.poll() is None:  # stuck: it must not outlive the benchmark
                self.process.kill()
                self.process.wait()


def serve_contender(who: str, dataset: str) -> None:
    """A contender's process: ``who`` (``fork`` or ``tether``) over ``dataset`` (a key of
    ``BIG``, or ``none``); one line of JSON on its stdout per command on its stdin (what
    else writes to stdout goes to stderr)."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    pool: Optional[tether.Pool] = None
    context: Any = "fork"
    if who == "tether":
        pool = tether.Pool(2, preload=["torch"])
        context = pool.context()
        twenty(multiprocessing_context=context)  # warm: workers up, torch imported
    make = BIG[dataset][1] if dataset in BIG else None
    data = make() if make is not None else None
    if data is not None and pool is not None:
        first_of(data, context)  # the pool has served it

    def served() -> float:
        return first_of(data, context) * 1000

    commands: Dict[str, Callable[[], Any]] = {
        "ready": lambda: True,
        "start": tether_pool_start if pool is not None else fork_pool_start,
        "served": served,
        # A new object of the same contents (made before the clock starts); fork's workers
        # see any object alike.
        "new": (
            (lambda: first_of(make(), context) * 1000)
            if pool is not None and make is not None
            else served
        ),
        "turns": lambda: loaders_in_turn(data, context),
    }
    for line in sys.stdin:
        answers.write(json.dumps(commands[line.strip()]()) + "\n")
        answers.flush()
    if pool is not None:
        pool.shutdown()


def tether_pool_start() -> float:
    """Milliseconds to start ``tether.Pool(2, preload=["torch"])`` (it returns once every
    worker is ready)."""
    start = time.perf_counter()
    pool = tether.Pool(2, preload=["torch"])
    elapsed = time.perf_counter() - start
    pool.shutdown()
    return elapsed * 1000


def fork_pool_start() -> float:
    """Milliseconds to start torch's ``multiprocessing`` pool of 2 fork workers."""
    start = time.perf_counter()
    pool = torch.multiprocessing.get_context("fork").Pool(2)
    pool.map(abs, [0, 1])  # its workers are up once they answered
    elapsed = time.perf_counter() - start
    pool.terminate()
    pool.join()
    return elapsed * 1000


def one_big_dataset(name: str, reps: int) -> None:
    title, make = BIG[name]
    with Contender("fork", name) as fork, Contender("tether", name) as ours:
        served = interleaved(
            {"torch fork": fork.command("served"), "tether.Pool": ours.command("served")}, reps
        )
        print_versus(f"{title}: first batch of a new loader, dataset served", "ms", served, True)
        new_object = interleaved(
            {
                # Of a new object too: a tensor's storage moves to shared memory at its first
                # pickling only.
                "one dumps + loads": lambda: dumps_loads(make()) * 1000,
                "torch fork": fork.command("new"),
                "tether.Pool": ours.command("new"),
            },
            reps,
        )
        print_versus(f"{title}: first loader over a new dataset object", "ms", new_object, True)
        turns = {"torch fork": fork.ask("turns"), "tether.Pool": ours.ask("turns")}
    print_versus(
        f"{title}: 20 loaders in turn (8 batches each)",
        "seconds",
        {k: v["seconds"] for k, v in turns.items()},
        True,
        digits=2,
    )
    print_versus(
        f"{title}: the 2 workers' PSS during the 20th loader",
        "MiB",
        {k: v["pss"] for k, v in turns.items()},
        True,
        digits=0,
    )


def twenty(**kwargs) -> float:
    start = time.perf_counter()
    for _ in range(20):
        for _batch in DataLoader(Small(), batch_size=16, num_workers=2, **kwargs):
            pass
    return time.perf_counter() - start


def first_batch(**kwargs) -> float:
    start = time.perf_counter()
    it = iter(DataLoader(Small(), batch_size=16, num_workers=2, **kwargs))
    next(it)
    elapsed = time.perf_counter() - start
    del it
    return elapsed


#: CPU seconds per batch of each ``throughput`` run since the last ``print_cpu``, by
#: contender: its workers', the parent's (from /proc, every thread).
CPU: Dict[str, List[Dict[str, float]]] = {}
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def throughput(batches: int, **kwargs) -> float:
    loader = DataLoader(Images(32 * (batches + 4)), batch_size=32, num_workers=2, **kwargs)
    it = iter(loader)
    for _ in range(4):
        next(it)
    pids = [os.getpid(), *(w.pid for w in it._workers)]
    before = [cpu_seconds(p) for p in pids]
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    elapsed = time.perf_counter() - start
    used = [cpu_seconds(p) - b for p, b in zip(pids, before)]
    name = "torch fork" if kwargs["multiprocessing_context"] == "fork" else "tether.Pool"
    CPU.setdefault(name, []).append(
        {"parent": used[0] / batches, "workers": sum(used[1:]) / batches}
    )
    del it
    return batches / elapsed


def print_cpu(title: str) -> None:
    """Where a steady-state batch's CPU time goes: medians of the runs since the last call."""
    print(f"\n{title}: CPU ms per batch")
    print(f"  {'':12} {'workers':>8} {'parent':>8}")
    for name, runs in CPU.items():
        workers = statistics.median(r["workers"] for r in runs) * 1000
        parent = statistics.median(r["parent"] for r in runs) * 1000
        print(f"  {name:12} {workers:8.1f} {parent:8.1f}")
    CPU.clear()


def interleaved(contenders: Dict[str, Callable[[], float]], reps: int) -> Dict[str, float]:
    samples: Dict[str, List[float]] = {name: [] for name in contenders}
    for _ in range(reps):
        for name, run in contenders.items():
            samples[name].append(run())
    return {name: statistics.median(values) for name, values in samples.items() if values}


@contextlib.contextmanager
def seed_context() -> Iterator[Optional[object]]:
    """The seed's reusable pool context, when the seeds are there."""
    if not os.path.isdir(SEEDS):
        yield None
        return
    sys.path.insert(0, SEEDS)
    import reusable_pool_context as seed

    with torch.multiprocessing.Pool(2) as mp_pool, seed.reusable_pool_context(mp_pool) as ctx:
        twenty(multiprocessing_context=ctx)  # warm
        yield ctx


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--spawn-reps", type=int, default=1)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--no-big", dest="big", action="store_false")
    parser.add_argument("--steady", action="store_true", help="only the steady state")
    parser.add_argument("--big-only", action="store_true", help="only the datasets of real size")
    parser.add_argument("--contender", nargs=2, metavar=("WHO", "DATASET"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.contender:
        serve_contender(*args.contender)
        return
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, medians of {args.reps} runs "
        f"(torch spawn: {args.spawn_reps})"
    )
    if args.big_only:
        big_datasets(args.reps)
        return
    pool = tether.Pool(2, preload=["torch"])
    ctx = pool.context()
    twenty(multiprocessing_context=ctx)  # warm: workers up, torch imported
    if not args.steady:
        loader_starts(ctx, args)
    steady_state(ctx, args)
    pool.shutdown()


def loader_starts(ctx: Any, args: argparse.Namespace) -> None:
    """Sections 1 to 3."""
    with seed_context() as seed:
        loaders: Dict[str, Callable[[], float]] = {
            "torch fork": lambda: twenty(multiprocessing_context="fork"),
            "torch fork, persistent_workers": lambda: twenty(
                multiprocessing_context="fork", persistent_workers=True
            ),
        }
        if seed is not None:
            loaders["seed reusable_pool_context"] = lambda: twenty(multiprocessing_context=seed)
        loaders["tether.Pool"] = lambda: twenty(multiprocessing_context=ctx)
        scenario = interleaved(loaders, args.reps)
        if args.spawn_reps:
            spawn = interleaved(
                {"torch spawn": lambda: twenty(multiprocessing_context="spawn")}, args.spawn_reps
            )
            scenario = {**spawn, **scenario}
        firsts: Dict[str, Callable[[], float]] = {
            "torch fork": lambda: first_batch(multiprocessing_context="fork") * 1000,
        }
        if seed is not None:
            firsts["seed reusable_pool_context"] = lambda: (
                first_batch(multiprocessing_context=seed) * 1000
            )
        firsts["tether.Pool"] = lambda: first_batch(multiprocessing_context=ctx) * 1000
        first = interleaved(firsts, max(args.reps, 5))
    print_versus(
        "20 DataLoaders (64 items, batch 16, 2 workers), one after the other",
        "seconds",
        scenario,
        True,
        digits=3,
    )
    print_versus("Time to the first batch of a new loader", "ms", first, True)
    if args.big:
        big_datasets(args.reps)


def steady_state(ctx: Any, args: argparse.Namespace) -> None:
    """Section 4."""
    steady: Dict[str, Callable[[], float]] = {
        "torch fork": lambda: throughput(args.batches, multiprocessing_context="fork"),
        "tether.Pool": lambda: throughput(args.batches, multiprocessing_context=ctx),
    }
    CPU.clear()
    rates = interleaved(steady, max(args.reps, 5))
    print_versus(
        "Steady state: batches of 32 x 3x224x224 float32, 2 workers", "batches/s", rates, False
    )
    print_cpu("Steady state")
    with busy_cores():
        busy = interleaved(steady, max(args.reps, 5))
    print_versus("Steady state, a busy-looping process on every core", "batches/s", busy, False)
    print_cpu("Steady state, every core busy")


if __name__ == "__main__":
    main()
