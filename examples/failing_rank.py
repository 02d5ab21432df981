"""Four ranks; rank 2 fails first with a ValueError, rank 3 a moment later. tether stops
the others and reports the root cause: the rank that failed first, with its traceback, and
the original exception object, rebuilt here (the error's ``__context__``)."""

import time

import tether


def work(rank: int, steps: int) -> None:
    for step in range(steps):
        time.sleep(0.05)
        if rank == 2 and step == 3:
            raise ValueError(f"rank {rank}: loss became NaN at step {step}")
        if rank == 3 and step == 6:
            raise RuntimeError("rank 3 failed too, but later")


if __name__ == "__main__":
    start = time.monotonic()
    try:
        tether.spawn(work, args=(100,), nprocs=4)
    except tether.ProcessRaisedException as e:
        elapsed = time.monotonic() - start
        print(f"root cause: rank {e.error_index} (pid {e.pid}), raised after {elapsed:.2f} s")
        print(str(e).strip())
        print(f"the original exception, rebuilt in the parent: {e.__context__!r}")
