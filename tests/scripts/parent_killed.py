"""A parent that will be killed with SIGKILL: it ignores SIGINT (as a background job of a
non-interactive shell does), starts children that ignore SIGINT and SIGTERM, each of which
starts grandchildren through tether too; prints every pid (with the zygote's, if any) as
one JSON line, then waits."""

import json
import multiprocessing
import os
import signal
import sys
import time

import tether


def stubborn(i, queue):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    queue.put(os.getpid())
    while True:
        time.sleep(1)


def child(i, queue, method):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tether.start_processes(stubborn, args=(queue,), nprocs=2, join=False, start_method=method)
    queue.put(os.getpid())
    while True:
        time.sleep(1)


if __name__ == "__main__":
    method = sys.argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    tether.start_processes(child, args=(queue, method), nprocs=2, join=False, start_method=method)
    pids = [queue.get() for _ in range(6)]
    from tether.zygote import client

    print(json.dumps(pids + client.pids()), flush=True)
    time.sleep(120)
