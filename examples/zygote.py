"""The zygote at work: from a script that imports torch, start 8 processes with the default
start method ("forkserver": forks of tether's warm zygote, which has torch imported once)
and compare with "spawn", where every child starts an interpreter and imports torch."""

import time

import torch  # what a training script has imported when it starts processes

import tether


def work(rank: int) -> None:
    torch.manual_seed(rank)
    torch.randn(64, 64) @ torch.randn(64, 64)


def timed(label: str, **kwargs) -> float:
    start = time.perf_counter()
    tether.start_processes(work, **kwargs)
    elapsed = time.perf_counter() - start
    print(f"{label:<44} {elapsed:7.2f} s", flush=True)
    return elapsed


if __name__ == "__main__":
    tether.warm_up(processes=8)  # the zygote imports torch in the background meanwhile
    spawn = timed("2 processes, start_method='spawn'", nprocs=2, start_method="spawn")
    first = timed("8 processes, zygote (first use)", nprocs=8)
    warm = timed("8 processes, zygote (warm)", nprocs=8)
    print(f"per process: spawn {spawn / 2:.2f} s, warm zygote {warm / 8 * 1e3:.1f} ms")
