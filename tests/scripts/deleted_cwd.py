"""Starts two ranks with the start method given, and a ``tether.Pool`` task, from a working
directory that was deleted; prints one JSON line: each error's type and message, or None
when it ran."""

import json
import os
import sys
import tempfile

import tether


def rank(i):
    pass


def square(x):
    return x * x


def main():
    method = sys.argv[1]
    gone = tempfile.mkdtemp()
    os.chdir(gone)
    os.rmdir(gone)
    out = {}
    try:
        tether.start_processes(rank, nprocs=2, start_method=method)
        out["start"] = None
    except OSError as exc:
        out["start"] = [type(exc).__name__, str(exc)]
    try:
        with tether.Pool(1, start_method=method) as pool:
            assert pool.submit(square, 3).result() == 9
        out["pool"] = None
    except OSError as exc:
        out["pool"] = [type(exc).__name__, str(exc)]
    os.chdir("/")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
