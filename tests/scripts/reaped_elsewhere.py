"""Rank 0 succeeds at once and rank 1 fails a moment later, while something else in this
process may take rank 0's exit status: SIGCHLD set to SIG_IGN (the kernel reaps every child
itself) or the program's own ``os.waitpid(-1, 0)``. Prints one JSON line: what join raised,
how rank 0's status reads, and, with SIGCHLD ignored, what a start where every rank
succeeds returns and warns."""

import json
import os
import signal
import sys
import threading
import time
import warnings

import tether


def ranks(i):
    if i == 1:
        time.sleep(0.3)
        raise ValueError("rank 1 failed")


def noop(i):
    pass


def main():
    method, how = sys.argv[1], sys.argv[2]
    options = {"start_method": method}
    if method == "forkserver":
        options["preload"] = []
    tether.start_processes(noop, nprocs=1, **options)  # everything up before SIGCHLD changes
    if how == "sigchld_ignored":
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    ctx = tether.start_processes(ranks, nprocs=2, join=False, **options)
    if how == "waitpid":
        reaper = threading.Thread(target=lambda: os.waitpid(ctx.pids()[0], 0), daemon=True)
        reaper.start()
    result = {}
    try:
        while not ctx.join():
            pass
    except tether.ProcessException as exc:
        result["raised"] = [type(exc).__name__, exc.error_index]
        result["message"] = str(exc)
    result["rank0"] = str(ctx.processes[0].status)
    if how == "sigchld_ignored":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result["all_ok"] = tether.start_processes(noop, nprocs=2, join=False, **options).join(
                30
            )
        result["warnings"] = [str(w.message) for w in caught]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
