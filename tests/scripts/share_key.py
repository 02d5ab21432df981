"""A rank of a job that asks for one shared key: ``share_key.py MODE LOG [KEY]``. Every call
of ``build()`` appends a line to LOG. MODE: ``ok``; ``quick`` (build() returns at once, and
the rank exits); ``raise`` (build() raises, and the rank prints what it caught); ``die``
(build() kills its process with SIGKILL); ``die-once`` (the first build() to run does);
``hold`` (after mapping the copy, the rank waits for its stdin to close). The rank prints
``rank=R pid=P inode=I len=N name=NAME``."""

import os
import signal
import sys
import time

import tether
from tether import _native
from tether.share import meeting

mode, log = sys.argv[1], sys.argv[2]
key = sys.argv[3] if len(sys.argv) > 3 else "imagenet"
rank = os.environ.get("RANK", "-1")


def build():
    with open(log, "a") as f:
        f.write(f"{rank} {os.getpid()} {meeting._job()}\n")
    if mode != "quick":
        time.sleep(0.5)  # the other ranks come meanwhile, and wait
    if mode == "raise":
        raise ValueError("no such dataset: imagenet")
    if mode == "die" or (mode == "die-once" and _first(log + ".died")):
        os.kill(os.getpid(), signal.SIGKILL)
    return [(f"/data/{i}.JPEG", i % 1000) for i in range(1000)]


def _first(marker):
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


name = _native.share_names(meeting._job(), key)[0].decode()
try:
    shared = tether.share(build, key=key)
except ValueError as exc:
    cause = str(exc.__cause__).strip().splitlines()[1] if exc.__cause__ else ""
    print(f"rank={rank} raised {type(exc).__name__}: {exc} | {cause}", flush=True)
    sys.exit(0)
inode = os.fstat(shared._fileno()).st_ino
print(f"rank={rank} pid={os.getpid()} inode={inode} len={len(shared)} name={name}", flush=True)
if mode == "hold":
    sys.stdin.read()
