"""A ``tether run`` rank that first looks for what earlier attempts left, then leaves
daemons of its own and fails (but in the last attempt).

Arguments: a directory and a mark. The rank writes ``seen.<attempt>.<rank>``: a JSON list
of every process of an earlier attempt it still finds, dead but unreaped (a zombie) or
alive, by the pids earlier attempts wrote and by the mark every leftover carries in its
environment (``LEFTOVER=<mark>-<attempt>``). Then it leaves, each in a session of its own:
a double-forked daemon, ``setsid sleep``, a daemon that holds 64 MiB and four threads (its
death takes a moment), and one that forks itself into a new session every few
milliseconds (no pid of it stays for long); it writes their pids (``pids.<attempt>.<rank>``)
once each has started, waits for the other ranks to have done the same, and exits 1 while
restarts are left.
"""

import json
import os
import subprocess
import sys
import threading
import time


def earlier_leftovers(directory: str, mark: str, attempt: int) -> list:
    found = []
    for name in os.listdir(directory):
        if not name.startswith("pids."):
            continue
        if int(name.split(".")[1]) >= attempt:
            continue
        with open(os.path.join(directory, name)) as f:
            for pid in json.load(f):
                try:
                    with open(f"/proc/{pid}/stat") as stat:
                        state = stat.read().rsplit(")", 1)[1].split()[0]
                except OSError:
                    continue
                found.append([name, pid, state])
    earlier = {f"LEFTOVER={mark}-{a}".encode() for a in range(attempt)}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = set(f.read().split(b"\0"))
        except OSError:
            continue
        if env & earlier:
            found.append(["marked", int(entry), ""])
    return found


def daemonize(ready: int, body) -> None:
    """Runs ``body`` in a double-forked process of a new session; it writes its pid on
    ``ready`` first."""
    if os.fork() == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                os.write(ready, f"{os.getpid()}\n".encode())
                body()
        finally:
            os._exit(0)
    os.wait()


def sleep_long() -> None:
    time.sleep(600)


def hold_memory_and_threads() -> None:
    held = bytearray(64 << 20)
    for i in range(0, len(held), 4096):
        held[i] = 1
    for _ in range(4):
        threading.Thread(target=sleep_long, daemon=True).start()
    sleep_long()


def hop() -> None:
    for _ in range(100_000):
        time.sleep(0.003)
        if os.fork() != 0:
            os._exit(0)
        os.setsid()


def main() -> None:
    directory, mark = sys.argv[1], sys.argv[2]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = os.environ["RANK"]
    seen = earlier_leftovers(directory, mark, attempt)
    with open(os.path.join(directory, f"seen.{attempt}.{rank}"), "w") as f:
        json.dump(seen, f)
    os.environ["LEFTOVER"] = f"{mark}-{attempt}"
    read, write = os.pipe()
    for body in (sleep_long, hold_memory_and_threads, hop):
        daemonize(write, body)
    sleeper = subprocess.Popen(["setsid", "sleep", "600"], stdout=subprocess.DEVNULL)
    os.close(write)
    with os.fdopen(read) as ready:
        pids = [int(ready.readline()) for _ in range(3)]
    pids.append(sleeper.pid)
    # setsid has made its session once the sleep runs (its pid keeps the name "sleep").
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{sleeper.pid}/comm") as f:
            if f.read().strip() == "sleep":
                break
        time.sleep(0.005)
    with open(os.path.join(directory, f"pids.{attempt}.{rank}"), "w") as f:
        json.dump(pids, f)
    # Every rank of the attempt has looked and left its daemons before any of them fails.
    world = int(os.environ["WORLD_SIZE"])
    others = [os.path.join(directory, f"pids.{attempt}.{r}") for r in range(world)]
    while time.monotonic() < deadline and not all(map(os.path.exists, others)):
        time.sleep(0.005)
    last = attempt == int(os.environ["TORCHELASTIC_MAX_RESTARTS"])
    sys.exit(0 if last else 1)


if __name__ == "__main__":
    main()
