"""Functions defined in a __main__ script, behind the usual guard, run in spawn children."""

import multiprocessing
import sys

import tether


def square(i, queue):
    queue.put((i, i * i, __name__))


if __name__ == "__main__":
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    tether.start_processes(square, args=(queue,), nprocs=3, start_method=sys.argv[1])
    print(sorted(queue.get() for _ in range(3)))
