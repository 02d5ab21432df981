"""The zygote at work: from a script that imports torch, start the same number of processes
with torch.multiprocessing.spawn (every child starts an interpreter and imports torch), then
with tether's default start method ("forkserver": forks of a warm zygote that imported torch
once), the first time (the zygote starts and imports torch) and warm. Each line gives the
wall time of one start of all the processes, and that time divided by their number."""

import time

import torch  # what a training script has imported when it starts processes
import torch.multiprocessing

import tether


def work(rank: int) -> None:
    torch.manual_seed(rank)
    torch.randn(64, 64) @ torch.randn(64, 64)


def timed(start) -> float:
    began = time.perf_counter()
    start()
    return time.perf_counter() - began


#: The same number of processes for torch and for tether.
PROCESSES = 2


def report(what: str, seconds: float, note: str = "") -> None:
    per = seconds / PROCESSES
    per_text = f"{per:.2f} s" if per >= 0.1 else f"{per * 1e3:.1f} ms"
    print(f"{what + ':':<43} {seconds:6.3f} s, {per_text} per process{note}")


if __name__ == "__main__":
    n = PROCESSES
    torch_spawn = timed(lambda: torch.multiprocessing.spawn(work, nprocs=n))
    report(f"torch.multiprocessing.spawn, {n} processes", torch_spawn)
    first = timed(lambda: tether.spawn(work, nprocs=n))
    report(f"tether, first use, {n} processes", first, " (starts the zygote: one import torch)")
    time.sleep(0.5)  # the zygote forks its next children ahead while idle
    warm = timed(lambda: tether.spawn(work, nprocs=n))
    report(f"tether, warm zygote, {n} processes", warm)
    print(
        f"{n} processes each: a warm tether start takes {torch_spawn / warm:.0f}x less time "
        "than torch's spawn"
    )
