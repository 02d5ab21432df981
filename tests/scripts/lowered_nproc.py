"""Runs as an unprivileged user and prints one JSON line: ``lowered_nproc.py UID MARGIN``.

The script becomes that user (a uid no other process uses: every task of that user is one of
this script's), starts 40 ranks through ``tether.spawn(..., start_method="forkserver")``,
lets them end and waits until the zygote keeps blanks for the next start. Then, as a program
would, it lowers its RLIMIT_NPROC to the tasks it runs (not counting tether's blanks) plus
MARGIN, and starts a thread and a subprocess. It reports the blanks before and after, how
the thread and the subprocess went, and, after a start with the ``spawn`` method that needs
more than the room the blanks leave, how that start went.
"""

import json
import resource
import subprocess
import sys
import threading
import time

from as_user import become
from under_nproc import user_tasks


def rank(i: int) -> None:
    pass


def blanks() -> int:
    from tether.zygote import client

    return len(client.pids()) - len(client.running())


def thread_starts() -> str:
    try:
        thread = threading.Thread(target=time.sleep, args=(0,))
        thread.start()
        thread.join()
        return "started"
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"


def subprocess_runs() -> str:
    try:
        return f"exit {subprocess.run(['true'], check=False).returncode}"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def main() -> None:
    uid, margin = int(sys.argv[1]), int(sys.argv[2])
    become(uid)
    import tether

    tether.spawn(rank, nprocs=40, start_method="forkserver")
    deadline = time.monotonic() + 30
    while blanks() < 40 and time.monotonic() < deadline:
        time.sleep(0.05)
    out = {"blanks_before": blanks()}
    own = user_tasks(uid) - out["blanks_before"]
    out["limit"] = own + margin
    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    resource.setrlimit(resource.RLIMIT_NPROC, (own + margin, hard))
    out["blanks_after"] = blanks()
    out["thread"] = thread_starts()
    out["subprocess"] = subprocess_runs()
    # The blanks left hold at most half of the room: a start of more than the other half
    # needs theirs too.
    try:
        tether.spawn(rank, nprocs=margin - 1, start_method="spawn")
        out["spawn"] = "ran"
    except Exception as exc:  # noqa: BLE001 - reported
        out["spawn"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
