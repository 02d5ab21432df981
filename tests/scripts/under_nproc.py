"""Runs as an unprivileged user under a lowered RLIMIT_NPROC and prints one JSON line.

Arguments: a uid no other process uses, the limit, a start method. The script lowers the
limit, becomes that user (keeping only the capabilities to read and write any file, through
exec too, so that it can still run this interpreter: RLIMIT_NPROC binds it as any user),
starts ``tether.Pool(40)``, which the limit cannot hold, and then reports: the error, the
tasks its user holds after the failure, whether a thread, a subprocess and a
``tether.Pool(20)`` still start, and the blanks the zygote keeps ready after that pool
(which asks for 20), with the room the limit left them.
"""

import json
import os
import resource
import subprocess
import sys
import threading
import time

from as_user import become


def user_tasks(uid: int) -> int:
    tasks = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        except OSError:
            continue
        if int(status["Uid"].split()[0]) == uid:
            tasks += int(status["Threads"])
    return tasks


def square(x: int) -> int:
    return x * x


def main() -> None:
    uid, limit, method = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
    become(uid)
    import tether
    from tether.zygote import client

    out = {}
    try:
        with tether.Pool(40, start_method=method) as pool:
            pool.submit(square, 2).result()
        out["error"] = None
    except OSError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["tasks_after"] = user_tasks(uid)
    thread = threading.Thread(target=time.sleep, args=(0,))
    thread.start()
    thread.join()
    out["subprocess"] = subprocess.run(["true"], check=False).returncode
    with tether.Pool(20, start_method=method) as pool:
        out["pool"] = pool.submit(square, 7).result()
    time.sleep(0.5)  # the zygote replenishes once idle
    blanks = len(client.pids()) - len(client.running())
    out["blanks"] = blanks
    out["room_for_blanks"] = limit - (user_tasks(uid) - blanks)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
