"""Starts processes while a resource is exhausted, then again once it is back; prints one
JSON line: the first start's error (type, errno, message), this process's fds and children
before and after it, and whether the second start worked.

    limits.py METHOD nofile            RLIMIT_NOFILE lowered to 64 during a start of 40
    limits.py METHOD nproc             RLIMIT_NPROC just above what this user runs
    limits.py METHOD pids CGROUP_DIR   a pids cgroup's pids.max (RLIMIT_NPROC binds no root)
"""

import gc
import json
import os
import resource
import sys
import time

import tether

RANKS = 40


def nap(i):
    time.sleep(0.3)


def children():
    me = str(os.getpid())
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if stat[stat.rfind(")") + 2 :].split()[1] == me:
                found.append(int(entry))
    return found


def own_fds():
    """This process's fds, less the pidfds that watch the zygote and its ready children
    (those come and go). The helpers are read after the fds: a child registered meanwhile
    is among them."""
    from tether.zygote import client

    pids = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                info = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        except OSError:
            continue
        pids[fd] = info.get("Pid", "").strip()
    helpers = {str(p) for p in client.pids()}
    return sorted(fd for fd, pid in pids.items() if pid not in helpers)


def settled_fds(expected):
    """This process's fds once the failed start's are closed (the warden thread drops
    its last hold on them a moment after the start returns), or after 2 s."""
    deadline = time.monotonic() + 2
    while True:
        gc.collect()  # the error's traceback holds the failed start's frames in a cycle
        found = own_fds()
        if found == expected or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def stray():
    """Children that are neither the zygote nor its ready children. One the zygote has just
    forked ahead is given a moment to be announced."""
    from tether.zygote import client

    deadline = time.monotonic() + 2
    while True:
        found = sorted(set(children()) - set(client.pids()))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def describe(fds):
    """What each fd is, for a failure message."""
    found = {}
    for fd in fds:
        try:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                found[fd] = [os.readlink(f"/proc/self/fd/{fd}"), f.read()]
        except OSError:
            pass
    return found


def own_processes(uid):
    return sum(1 for p in os.listdir("/proc") if p.isdigit() and _uid(p) == uid)


def _uid(pid):
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def exhaust(kind, cgroup):
    """Takes the resource away; returns how to give it back."""
    if kind == "nofile":
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if kind == "nproc":
        soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
        resource.setrlimit(resource.RLIMIT_NPROC, (own_processes(os.getuid()) + 10, hard))
        return lambda: resource.setrlimit(resource.RLIMIT_NPROC, (soft, hard))
    with open(f"{cgroup}/pids.current") as f:
        current = int(f.read())
    with open(f"{cgroup}/pids.max", "w") as f:
        f.write(str(current + 10))

    def restore():
        with open(f"{cgroup}/pids.max", "w") as f:
            f.write("max")

    return restore


def main():
    method, kind = sys.argv[1], sys.argv[2]
    cgroup = sys.argv[3] if kind == "pids" else None
    if cgroup is not None:
        with open(f"{cgroup}/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
    options = {"start_method": method}
    if method == "forkserver":
        options["preload"] = []
    tether.start_processes(nap, nprocs=2, **options)  # the zygote and warden are up
    time.sleep(0.5)  # the zygote's ready children are forked

    fds_before = own_fds()
    restore = exhaust(kind, cgroup)
    error = None
    try:
        tether.start_processes(nap, nprocs=RANKS, **options)
    except OSError as exc:
        error = [type(exc).__name__, exc.errno, str(exc)]
    finally:
        restore()
    result = {
        "error": error,
        "fds_before": fds_before,
        "fds_after": settled_fds(fds_before),
        "extra": describe(set(own_fds()) - set(fds_before)),
        "stray": stray(),
    }
    tether.start_processes(nap, nprocs=RANKS, **options)
    result["second_start"] = True
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
