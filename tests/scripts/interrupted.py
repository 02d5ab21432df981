"""A parent in join() that will get Ctrl-C: prints its children's pids, then joins. With
"stubborn", the children ignore SIGINT and SIGTERM, so only a second Ctrl-C (SIGKILL)
stops them in time; with "before-join", the Ctrl-C comes before join()."""

import json
import multiprocessing
import os
import signal
import sys
import time

import tether


def sleeper(i, queue, stubborn):
    if stubborn:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    queue.put(os.getpid())
    while True:
        time.sleep(1)


if __name__ == "__main__":
    method, stubborn = sys.argv[1], sys.argv[2] == "stubborn"
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    ctx = tether.start_processes(
        sleeper, args=(queue, stubborn), nprocs=2, join=False, start_method=method
    )
    pids = [queue.get() for _ in range(2)]
    print(json.dumps(pids), flush=True)
    if "before-join" in sys.argv:
        time.sleep(30)  # Ctrl-C lands here, outside join()
    try:
        ctx.join()
    except KeyboardInterrupt:
        print("alive after interrupt:", [p.is_alive() for p in ctx.processes], flush=True)
        raise
