"""tether.share against a plain list, with torch's fork workers and tether.Pool, in one run.

    python bench/share.py [--reps N] [--epochs N] [--samples N] [--batch N] [--no-ranks]

An ImageFolder-like dataset (1,281,167 ``(path, class)`` samples, as torchvision's
ImageFolder over ImageNet's train set; ``__getitem__`` returns the sample), shuffled, 2
workers, ``--epochs`` epochs (3) of one loader (``persistent_workers=True`` with fork, so
that the same workers run every epoch, as on a pool):

1. Building: one ``pickle.dumps`` of the list against ``tether.share(list)``; reading a
   random item of the list and of the shared list.
2. Four contenders, each in a process of its own, taking turns within each repetition:
   torch fork over the plain list, ``tether.Pool`` over the plain list, and both over
   ``tether.share(list)``. For each: the workers' summed PSS after the first batch and
   after each epoch, and each epoch's time. The pool's workers are spawned (a zygote's
   children share pages with its ready children, which come and go: their PSS moves by tens
   of MiB whatever the samples do). PSS counts anonymous and shared memory
   (``Pss_Anon + Pss_Shmem`` of ``/proc/PID/smaps_rollup``), not the files mapped (the
   shared libraries' pages move with other processes). "Samples add" is the workers' PSS
   at the end minus that of the same kind of workers (2 fork workers of the same parent,
   or the pool's own) before the list exists; "anon grows" is the workers' anonymous PSS
   from the first batch to the end.
3. ``tether run`` with 2 ranks x 2 fork workers, one epoch, with the key form
   (``tether.share(build, key=...)``) and with a plain list in each rank: the machine's
   total PSS of the samples (every rank's and worker's PSS at the end minus before the
   list exists), and the PSS of the shared memfd summed over every process that maps it.

Targets: samples add at most 0.2x with ``tether.share`` what they add with fork over a plain
list; the workers' anonymous memory grows under 30 MiB from the first batch to the end; an
epoch over the shared list takes at most 1.1x the time over a plain list with fork;
building costs at most 1.5x one ``pickle.dumps``."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

MiB = 2**20
CONTENDERS = ("fork/list", "pool/list", "fork/share", "pool/share")
HERE = Path(__file__).resolve()


def samples(n: int) -> List[Tuple[str, int]]:
    return [
        (f"/data/imagenet/train/n{i // 1300:08d}/n{i // 1300:08d}_{i}.JPEG", i // 1300)
        for i in range(n)
    ]


def rollup(pid: int) -> Dict[str, int]:
    """``/proc/PID/smaps_rollup``'s fields, in bytes."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                fields[name] = int(parts[0]) * 1024
    return fields


def memory(pids: Sequence[int]) -> Dict[str, int]:
    """Summed over ``pids``: PSS of anonymous and shared memory, and anonymous alone."""
    total = {"pss": 0, "anon": 0}
    for pid in pids:
        r = rollup(pid)
        total["pss"] += r.get("Pss_Anon", 0) + r.get("Pss_Shmem", 0)
        total["anon"] += r.get("Pss_Anon", 0)
    return total


def cpu_seconds(pids: Sequence[int]) -> float:
    """The CPU time (user and system) ``pids`` have used, summed."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / ticks


def shared_pss(pids: Sequence[int]) -> Tuple[int, int]:
    """The PSS of tether.share's memfds summed over ``pids``, and how many map one."""
    total, mapping = 0, 0
    for pid in pids:
        inside, found = False, False
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split()
                if head and "-" in head[0] and len(head) >= 5:
                    inside = "memfd:tether.share" in line
                    found = found or inside
                elif inside and head and head[0] == "Pss:":
                    total += int(head[1]) * 1024
        mapping += found
    return total, mapping


# -- one contender, in a process of its own ---------------------------------------------------


def contender(name: str, n: int, epochs: int, batch: int) -> Dict[str, Any]:
    """One contender's run (see the module's documentation), as a dict of figures."""
    from torch.utils.data import DataLoader

    import tether

    kind, holder = name.split("/")
    # Spawn workers: a zygote's children share its pages with its ready children, whose
    # coming and going moves the workers' PSS by tens of MiB, whatever the samples do.
    pool = tether.Pool(2, start_method="spawn") if kind == "pool" else None

    def loader(dataset: Any) -> Any:
        return DataLoader(
            dataset,
            batch_size=batch,
            shuffle=True,
            num_workers=2,
            persistent_workers=pool is None,
            multiprocessing_context=pool.context() if pool else "fork",
        )

    def workers(loader: Any) -> List[int]:
        return list(pool.pids()) if pool else [w.pid for w in loader._iterator._workers]

    # The same kind of workers before the list exists: their memory is the baseline.
    tiny = loader(Folder(samples(batch)))
    next(iter(tiny))
    base = memory(workers(tiny))
    del tiny
    data: Any = samples(n)
    if holder == "share":
        data = tether.share(data)
    main = loader(Folder(data))
    first, after, times, cpu = None, [], [], []
    for _ in range(epochs):
        start, used = time.perf_counter(), None
        for _ in iter(main):
            if used is None:
                used = cpu_seconds(workers(main))
            if first is None:
                first = memory(workers(main))
        times.append(time.perf_counter() - start)
        cpu.append(cpu_seconds(workers(main)) - (used or 0.0))
        after.append(memory(workers(main)))
    del main
    if pool is not None:
        pool.shutdown()
    return {"base": base, "first": first, "after": after, "times": times, "cpu": cpu}


class Folder:
    """torch's map-style protocol, as torchvision's ImageFolder: ``samples`` of ``(path,
    class)``; ``__getitem__`` returns the sample (the image is not loaded)."""

    def __init__(self, items: Any) -> None:
        self.samples = items

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Any:
        return self.samples[i]


# -- one rank of a `tether run` job -------------------------------------------------------


def barrier(out: Path, stage: str) -> None:
    """Waits until every rank of the job has reached ``stage``."""
    (out / f"{stage}.{os.environ['RANK']}").touch()
    world = int(os.environ["WORLD_SIZE"])
    deadline = time.monotonic() + 600
    while len(list(out.glob(f"{stage}.*"))) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other ranks never reached {stage}")
        time.sleep(0.05)


def rank(mode: str, n: int, batch: int, out: Path) -> None:
    """A rank: the same flow as a fork contender, over one epoch, with the list built in
    every rank (``plain``) or once for the machine (``key``); its own and its workers'
    memory go to ``out``."""
    from torch.utils.data import DataLoader

    import tether

    def loader(dataset: Any) -> Any:
        return DataLoader(
            dataset,
            batch_size=batch,
            shuffle=True,
            num_workers=2,
            persistent_workers=True,
            multiprocessing_context="fork",
        )

    def processes(loader: Any) -> List[int]:
        return [os.getpid(), *(w.pid for w in loader._iterator._workers)]

    tiny = loader(Folder(samples(batch)))
    next(iter(tiny))
    base = memory(processes(tiny))
    del tiny
    if mode == "key":
        data: Any = tether.share(lambda: samples(n), key="bench: ImageFolder-like samples")
    else:
        data = samples(n)
    main = loader(Folder(data))
    for _ in iter(main):
        pass
    barrier(out, "epoch")
    pids = processes(main)
    end = memory(pids)
    pss, mapping = shared_pss(pids)
    result = {"base": base, "end": end, "shared_pss": pss, "mapping": mapping}
    (out / f"result.{os.environ['RANK']}.json").write_text(json.dumps(result))
    barrier(out, "measured")


# -- the benchmark --------------------------------------------------------------------------


def run_contender(name: str, args: argparse.Namespace) -> Dict[str, Any]:
    argv = [
        sys.executable,
        str(HERE),
        "--contender",
        name,
        "--samples",
        str(args.samples),
        "--epochs",
        str(args.epochs),
        "--batch",
        str(args.batch),
    ]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_ranks(mode: str, args: argparse.Namespace) -> Dict[str, float]:
    tether = str(Path(sys.executable).with_name("tether"))
    with tempfile.TemporaryDirectory() as tmp:
        argv = [
            tether,
            "run",
            "--nproc-per-node",
            "2",
            str(HERE),
            "--rank-mode",
            mode,
            "--out",
            tmp,
            "--samples",
            str(args.samples),
            "--batch",
            str(args.batch),
        ]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        results = [json.loads(p.read_text()) for p in Path(tmp).glob("result.*.json")]
    return {
        "added": sum(r["end"]["pss"] - r["base"]["pss"] for r in results),
        "shared_pss": sum(r["shared_pss"] for r in results),
        "mapping": sum(r["mapping"] for r in results),
    }


def median(values: List[float]) -> float:
    return statistics.median(values)


def mib(b: float) -> str:
    return f"{b / MiB:,.0f} MiB"


def building_and_reading(n: int, reps: int) -> None:
    """One ``pickle.dumps`` of the list against ``tether.share`` of it; then the time of
    reading a random item (100,000 of them, in a loop that drops each), of the plain list
    and of the shared one, taking turns."""
    import random

    import tether

    before = rollup(os.getpid())["Anonymous"]
    items = samples(n)
    objects = rollup(os.getpid())["Anonymous"] - before
    dumps, share = [], []
    for _ in range(reps):
        start = time.perf_counter()
        pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
        dumps.append(time.perf_counter() - start)
        start = time.perf_counter()
        shared = tether.share(items)
        share.append(time.perf_counter() - start)
        size = shared._nbytes
    d, s = statistics.median(dumps), statistics.median(share)
    print(
        f"building from a list of {n:,} samples (median of {reps}): pickle.dumps {d:.3f} s, "
        f"tether.share {s:.3f} s ({s / d:.2f}x); the memfd holds {mib(size)}, the list's "
        f"objects {mib(objects)}"
    )
    indexes = [random.randrange(n) for _ in range(100_000)]
    reads: Dict[str, List[float]] = {"list": [], "tether.share": []}
    for _ in range(max(reps, 5)):
        for name, seq in (("list", items), ("tether.share", shared)):
            start = time.perf_counter()
            for i in indexes:
                seq[i]
            reads[name].append((time.perf_counter() - start) / len(indexes) * 1e6)
    r = {name: median(v) for name, v in reads.items()}
    print(
        f"reading a random item (median of {max(reps, 5)} x 100,000): list "
        f"{r['list']:.2f} us, tether.share {r['tether.share']:.2f} us"
    )


def row(name: str, cells: List[str]) -> None:
    print(f"  {name:12}" + "".join(f"{c:>14}" for c in cells))


def report(runs: Dict[str, List[Dict[str, Any]]], epochs: int) -> None:
    """The contenders' figures (medians over the repetitions) and the ratios."""
    print("\nworkers' summed PSS (anon + shmem), medians:")
    row(
        "", ["first batch", *(f"epoch {e + 1}" for e in range(epochs)), "samples add", "anon grows"]
    )
    added = {}
    for name, rs in runs.items():
        added[name] = median([r["after"][-1]["pss"] - r["base"]["pss"] for r in rs])
        cells = [mib(median([r["first"]["pss"] for r in rs]))]
        cells += [mib(median([r["after"][e]["pss"] for r in rs])) for e in range(epochs)]
        cells += [mib(added[name])]
        cells += [mib(median([r["after"][-1]["anon"] - r["first"]["anon"] for r in rs]))]
        row(name, cells)
    for name in ("fork/share", "pool/share", "pool/list"):
        print(f"  samples add with {name}: {added[name] / added['fork/list']:.2f}x fork/list's")
    print("\nepoch time (wall) and the workers' CPU time in it, medians:")
    row("", [*(f"epoch {e + 1}" for e in range(epochs)), *(f"CPU {e + 1}" for e in range(epochs))])
    for name, rs in runs.items():
        cells = [f"{median([r['times'][e] for r in rs]):.2f} s" for e in range(epochs)]
        cells += [f"{median([r['cpu'][e] for r in rs]):.2f} s" for e in range(epochs)]
        row(name, cells)
    for what, field in (("epoch time", "times"), ("workers' CPU time", "cpu")):
        for name in ("fork/share", "pool/share"):
            ratios = [
                median([r[field][e] for r in runs[name]])
                / median([r[field][e] for r in runs["fork/list"]])
                for e in range(epochs)
            ]
            print(f"  {what}, {name} / fork/list: " + ", ".join(f"{x:.2f}x" for x in ratios))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1_281_167)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--no-ranks", action="store_true")
    parser.add_argument("--contender", choices=CONTENDERS)
    parser.add_argument("--rank-mode", choices=("key", "plain"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.contender:
        result = contender(args.contender, args.samples, args.epochs, args.batch)
        print(json.dumps(result))
        return
    if args.rank_mode:
        rank(args.rank_mode, args.samples, args.batch, args.out)
        return
    print(
        f"ImageFolder-like list of {args.samples:,} samples, 2 workers, batches of "
        f"{args.batch}, shuffled, {args.epochs} epochs, {args.reps} repetitions"
    )
    building_and_reading(args.samples, max(args.reps, 3))
    runs: Dict[str, List[Dict[str, Any]]] = {name: [] for name in CONTENDERS}
    for _ in range(args.reps):
        for name in CONTENDERS:
            runs[name].append(run_contender(name, args))
    report(runs, args.epochs)
    if args.no_ranks:
        return
    print("\ntether run, 2 ranks x 2 fork workers, one epoch each:")
    for mode, what in (
        ("plain", "a plain list in each rank"),
        ("key", "tether.share(build, key=...)"),
    ):
        got = run_ranks(mode, args)
        line = f"  {what}: the samples add {mib(got['added'])} to the machine's PSS"
        if mode == "key":
            line += (
                f"; the shared memfd's PSS summed over the {got['mapping']} processes "
                f"that map it: {mib(got['shared_pss'])}"
            )
        print(line)


if __name__ == "__main__":
    main()
