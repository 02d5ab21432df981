"""Stacks on demand: how long from the request to every rank's stack, and what registering
the dump handler adds to a child's start.

    python bench/stacks.py [--reps 20] [--ranks 8]

- ``ProcessContext.stacks()`` over ``--ranks`` forkserver ranks stuck in ``time.sleep``;
- ``tether run -n RANKS`` given SIGUSR1: from the signal to the last rank's stack read from
  the launcher's stderr (targets: under 100 ms for 8 ranks);
- the registration itself, cold, in a fresh interpreter that has imported tether (what a
  spawn, zygote or fork child does before running the function): target under 1 ms;
- a ``tether run`` rank, which registers from ``tether_stacks.pth`` at interpreter start:
  the start of ``python -c pass`` with the stacks channel against without it.

Medians over the repetitions."""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _table import fmt_seconds, median, print_table

import tether


def sleeper(i: int) -> None:
    time.sleep(600)


def until_all_answer(ctx: tether.ProcessContext) -> None:
    end = time.monotonic() + 60
    while not all("in sleeper" in t for t in ctx.stacks().values()):
        if time.monotonic() > end:
            raise RuntimeError("the ranks never answered")
        time.sleep(0.05)


def context_stacks(ranks: int, reps: int) -> List[float]:
    ctx = tether.start_processes(sleeper, nprocs=ranks, join=False)
    assert ctx is not None
    try:
        until_all_answer(ctx)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            stacks = ctx.stacks()
            times.append(time.perf_counter() - start)
            assert all("in sleeper" in t for t in stacks.values())
        return times
    finally:
        for p in ctx.processes:
            p.kill()
        try:
            ctx.join()
        except tether.ProcessException:
            pass


RANK = textwrap.dedent(
    """
    import time
    print("ready", flush=True)
    def sleeper():
        time.sleep(600)
    sleeper()
    """
)


def read_until(fd: int, needle: bytes, buffer: bytearray, limit: float) -> None:
    end = time.monotonic() + limit
    while needle not in buffer:
        left = end - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise RuntimeError(f"{needle!r} never came: {bytes(buffer[-2000:])!r}")
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            raise RuntimeError("the launcher ended")
        buffer += chunk


def launcher_stacks(ranks: int, reps: int) -> List[float]:
    """From SIGUSR1 to the last rank's stack on the launcher's stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "rank.py")
        with open(script, "w") as f:
            f.write(RANK)
        tether_cli = os.path.join(os.path.dirname(sys.executable), "tether")
        proc = subprocess.Popen(
            [tether_cli, "run", "-n", str(ranks), script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stderr is not None
        try:
            out = bytearray()
            for r in range(ranks):
                read_until(proc.stdout.fileno(), f"[rank {r}]: ready".encode(), out, 60)
            last = f'[rank {ranks - 1}]:   File "{script}", line 6 in <module>\n'.encode()
            times = []
            for _ in range(reps + 1):
                err = bytearray()
                start = time.perf_counter()
                os.kill(proc.pid, signal.SIGUSR1)
                read_until(proc.stderr.fileno(), last, err, 30)
                times.append(time.perf_counter() - start)
                assert b"answered" in err and b"in sleeper" in err
            return times[1:]  # the first request also starts the launcher's thread
        finally:
            proc.terminate()
            proc.wait(60)


REGISTER = textwrap.dedent(
    """
    import os, sys, time
    import tether
    from tether import _native
    fd = int(sys.argv[1])
    start = time.perf_counter()
    _native.install_stack_handler(fd)
    print(time.perf_counter() - start)
    """
)


def registration(reps: int) -> List[float]:
    """The registration, cold, in a fresh interpreter that has imported tether."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with ours, theirs:
        fd = str(theirs.fileno())
        argv = [sys.executable, "-c", REGISTER, fd]
        return [
            float(
                subprocess.run(
                    argv, pass_fds=[theirs.fileno()], capture_output=True, text=True, check=True
                ).stdout
            )
            for _ in range(reps)
        ]


def python_start(reps: int) -> List[List[float]]:
    """``python -c pass`` without and with the stacks channel, interleaved."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with ours, theirs:
        plain = {k: v for k, v in os.environ.items() if k != "TETHER_STACKS_FD"}
        value = f"{theirs.fileno()}:{os.fstat(theirs.fileno()).st_ino}"
        channel = dict(plain, TETHER_STACKS_FD=value)
        samples: List[List[float]] = [[], []]
        for _ in range(reps):
            for i, env in enumerate((plain, channel)):
                start = time.perf_counter()
                subprocess.run(
                    [sys.executable, "-c", "pass"], env=env, pass_fds=[theirs.fileno()], check=True
                )
                samples[i].append(time.perf_counter() - start)
        return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=8)
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores, {args.reps} repetitions, {args.ranks} ranks")
    ctx = median(context_stacks(args.ranks, args.reps))
    run = median(launcher_stacks(args.ranks, args.reps))
    reg = median(registration(args.reps))
    plain, channel = (median(s) for s in python_start(args.reps))
    print_table(
        "request to every stack",
        ["median", "target"],
        [
            (f"ProcessContext.stacks(), {args.ranks} ranks", [fmt_seconds(ctx), "< 100 ms"]),
            (f"tether run SIGUSR1 to printed, {args.ranks} ranks", [fmt_seconds(run), "< 100 ms"]),
        ],
    )
    print_table(
        "what registering adds to a child's start",
        ["median", "target"],
        [
            ("spawn/zygote/fork child (tether imported)", [fmt_seconds(reg), "< 1 ms"]),
            ("tether run rank: python -c pass, plain", [fmt_seconds(plain), ""]),
            ("tether run rank: with the stacks channel", [fmt_seconds(channel), ""]),
            ("tether run rank: difference", [fmt_seconds(channel - plain), ""]),
        ],
    )


if __name__ == "__main__":
    main()
