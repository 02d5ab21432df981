"""A parent in join() that will get Ctrl-C, with children that do not stop on SIGINT: rank 0
ignores it, rank 1 is stuck in a C wait that retries on EINTR (a mutex, as in a C++
TCPStore connect: Python's SIGINT handler only sets a flag that nothing reads there), and
rank 2, when there are three, ignores SIGINT and SIGTERM. Prints the children's pids, then
joins with the grace period given (none when "default")."""

import ctypes
import json
import multiprocessing
import os
import signal
import sys
import time

import tether


def deaf(i, queue):
    if i in (0, 2):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if i == 2:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    queue.put((i, os.getpid()))
    if i == 1:
        libc = ctypes.CDLL(None)
        mutex = ctypes.create_string_buffer(64)
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    nprocs, grace = int(sys.argv[1]), sys.argv[2]
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    ctx = tether.start_processes(deaf, args=(queue,), nprocs=nprocs, join=False)
    pids = dict(queue.get() for _ in range(nprocs))
    print(json.dumps([pids[i] for i in range(nprocs)]), flush=True)
    try:
        ctx.join(grace_period=None if grace == "default" else float(grace))
    except KeyboardInterrupt:
        print("exit codes:", [p.exitcode for p in ctx.processes], flush=True)
        raise
