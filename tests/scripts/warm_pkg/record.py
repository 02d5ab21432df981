"""What a rank sees, recorded as JSON in ``OUT/<restart count>.<rank>.json`` by ``run()``:
the probe of warm ranks, run as ``warm_probe.py OUT [ARGS...]`` or ``-m warm_pkg.probe OUT
[ARGS...]`` under torchrun, under ``tether run`` (warm ranks) and as ``python -u`` through
``--no-python``, to compare. With ``PROBE_CHILDREN=1`` it also starts a multiprocessing spawn
child and a fork child, two DataLoader workers and a nested ``tether.spawn``, and reports
what they saw (torch and numpy are imported first). In attempt 0, rank 0 exits 3 once it has
recorded everything and the other ranks have ended, when ``PROBE_FAIL_FIRST=1`` (a launcher
with restarts starts attempt 1).
Every rank writes ``OUT/atexit.<restart count>.<rank>`` from an ``atexit`` handler."""

import atexit
import json
import multiprocessing
import os
import random
import resource
import signal
import sys
import time

STARTED = time.time()
OUT = sys.argv[1]
RANK = os.environ.get("RANK", "?")
ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")


def fds():
    """Every open fd and what it is (a pipe, a socket, a file's path)."""
    seen = {}
    for fd in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own fd
        seen[fd] = target.split(":")[0] if target.startswith(("pipe:", "socket:")) else target
    return seen


def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return line.split()[1]
    return None


def proc_list(name):
    with open(f"/proc/self/{name}", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]


def limits():
    return {
        name: resource.getrlimit(getattr(resource, name))
        for name in sorted(dir(resource))
        if name.startswith("RLIMIT_")
    }


def dispositions():
    found = {}
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        found[int(sig)] = getattr(handler, "__name__", repr(handler))
    return found


def umask():
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def random_state():
    if os.environ.get("PROBE_CHILDREN") == "1":
        import numpy  # noqa: F401
        import torch  # noqa: F401
    state = {"random": random.random(), "numpy": None, "torch_seed": None}
    if "numpy" in sys.modules:
        state["numpy"] = float(sys.modules["numpy"].random.random())
    if "torch" in sys.modules:
        state["torch_seed"] = sys.modules["torch"].initial_seed()
    return state


def main_module():
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    return {
        "name": main.__name__,
        "file": getattr(main, "__file__", None),
        "spec": None if spec is None else spec.name,
        "package": getattr(main, "__package__", None),
    }


def facts():
    return {
        "argv": sys.argv,
        "orig_argv": getattr(sys, "orig_argv", None),
        "executable": sys.executable,
        "path0": sys.path[0],
        "path": sys.path,
        "main": main_module(),
        "flags": list(sys.flags),
        "unbuffered": [sys.stdout.write_through, sys.stderr.write_through],
        "stdout_buffer": type(sys.stdout.buffer).__name__,
        "cwd": os.getcwd(),
        "umask": umask(),
        "limits": limits(),
        "nice": os.nice(0),
        "affinity": sorted(os.sched_getaffinity(0)),
        "env": dict(os.environ),
        "proc_environ": proc_list("environ"),
        "signals": dispositions(),
        "sig_blocked": status("SigBlk"),
        "sig_ignored": status("SigIgn"),
        "sig_caught": status("SigCgt"),
        "fds": fds(),
        "cmdline": proc_list("cmdline"),
        "comm": open("/proc/self/comm").read().strip(),
        "pgid_is_pid": os.getpgid(0) == os.getpid(),
        "random": random_state(),
        "authkey": bytes(multiprocessing.current_process().authkey).hex(),
        "hash": hash("tether"),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "started": STARTED,
    }


def spawn_child(queue):
    main = sys.modules["__main__"]
    queue.put({"name": main.__name__, "file": getattr(main, "__file__", None), "ok": True})


def fork_child(queue):
    queue.put({"ppid": os.getppid(), "ok": True})


def nested(rank, out):
    with open(os.path.join(out, f"nested.{RANK}.{ATTEMPT}.{rank}"), "w") as f:
        f.write(str(os.getppid()))


def children():
    seen = {}
    for method, target in (("spawn", spawn_child), ("fork", fork_child)):
        ctx = multiprocessing.get_context(method)
        queue = ctx.Queue()
        process = ctx.Process(target=target, args=(queue,))
        process.start()
        seen[method] = queue.get(timeout=60)
        process.join(60)
        seen[method]["exitcode"] = process.exitcode
    import torch.utils.data

    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, num_workers=2)
    seen["dataloader"] = [batch.tolist() for batch in loader]
    import tether

    tether.spawn(nested, args=(OUT,), nprocs=2)
    seen["nested"] = sorted(n for n in os.listdir(OUT) if n.startswith(f"nested.{RANK}.{ATTEMPT}."))
    return seen


def at_exit():
    with open(os.path.join(OUT, f"atexit.{ATTEMPT}.{RANK}"), "w") as f:
        f.write("ran")


def run():
    atexit.register(at_exit)
    record = facts()
    if os.environ.get("PROBE_CHILDREN") == "1":
        record["children"] = children()
    path = os.path.join(OUT, f"{ATTEMPT}.{RANK}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.rename(path + ".tmp", path)
    if os.environ.get("PROBE_FAIL_FIRST") == "1" and ATTEMPT == "0" and RANK == "0":
        # Every other rank has ended (its atexit handler ran) before this one fails.
        others = [f"atexit.{ATTEMPT}.{r}" for r in range(1, int(os.environ["WORLD_SIZE"]))]
        deadline = time.monotonic() + 60
        while not all(os.path.exists(os.path.join(OUT, n)) for n in others):
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        sys.exit(3)
