"""A parent that starts children with join=False and returns from its main module: like
multiprocessing, it stops daemonic children at exit and waits for the others."""

import json
import sys
import time

import tether


def work(i, seconds):
    time.sleep(seconds)


if __name__ == "__main__":
    daemon = sys.argv[1] == "daemon"
    ctx = tether.start_processes(
        work, args=(60 if daemon else 3.0,), nprocs=2, join=False, daemon=daemon
    )
    print(json.dumps(ctx.pids()), flush=True)
    print(f"main done at {time.monotonic()}", flush=True)
