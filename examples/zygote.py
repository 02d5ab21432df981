"""The zygote at work: from a script that imports torch, start processes with
torch.multiprocessing.spawn (every child starts an interpreter and imports torch), then with
tether's default start method ("forkserver": forks of a warm zygote that imported torch
once), the first time (the zygote starts and imports torch) and warm."""

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


if __name__ == "__main__":
    torch_spawn = timed(lambda: torch.multiprocessing.spawn(work, nprocs=2))
    print(
        f"torch.multiprocessing.spawn, 2 processes:   {torch_spawn:6.2f} s "
        f"({torch_spawn / 2:.2f} s per process)"
    )
    first = timed(lambda: tether.spawn(work, nprocs=8))
    print(
        f"tether zygote, first use, 8 processes:     {first:6.2f} s "
        "(starts the zygote, which imports torch once)"
    )
    time.sleep(0.5)  # the zygote forks its next children ahead while idle
    warm = timed(lambda: tether.spawn(work, nprocs=8))
    print(
        f"tether zygote, warm, 8 processes:          {warm:6.3f} s "
        f"({warm / 8 * 1e3:.1f} ms per process, {torch_spawn / 2 / (warm / 8):.0f}x "
        "less than torch's spawn)"
    )
