"""The scenarios of the watch's tests, generated, and the runner that plays them: a
``tether run`` of ``watch_job.py`` per job, its lines read as they come (each with the time
it arrived), a fault released (SIGUSR2, SIGCONT after a stop) once it was reported or its
time ran out, and what the watch said scored against what was injected.

A job holds several scenarios one after another (a fault, then healthy steps long enough for
the watch to forget the hang it printed), so that sixty cost a few jobs' start-up; jobs run
a few at a time."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

SCRIPT = str(Path(__file__).with_name("watch_job.py"))
#: The time between looks plus a look's own time, twice: what the report may take past
#: ``max(2 s, 3 x step)``.
ALLOWANCE = 0.75
#: Healthy time between a fault's release and the next fault.
GAP = 3.5


@dataclass
class Fault:
    kind: str
    rank: int
    step: int = 0


@dataclass
class Job:
    nproc: int
    step: float
    faults: List[Fault] = field(default_factory=list)
    jitter: float = 0.25
    steps: int = 0
    env: Dict[str, str] = field(default_factory=dict)
    #: A straggler: (rank, factor), slow from step 0.
    slow: Optional[Tuple[int, float]] = None
    name: str = ""

    def expected_after(self) -> float:
        return max(2.0, 3 * self.step)

    def plan(self) -> str:
        gap = int(GAP / self.step) + 1
        items = []
        at = int(4.0 / self.step) + 3
        for fault in self.faults:
            fault.step = at
            items.append(f"{at}:{fault.kind}:{fault.rank}")
            at += gap
        if self.slow:
            items.append(f"0:slow:{self.slow[0]}")
        if not self.steps:
            self.steps = at + 2
        return ",".join(items)


@dataclass
class Seen:
    """What one fault got: when it came, when it was reported, and whom the report named."""

    fault: Fault
    at: float
    reported: Optional[float] = None
    named: List[int] = field(default_factory=list)

    def delay(self) -> Optional[float]:
        return None if self.reported is None else self.reported - self.at


@dataclass
class Outcome:
    job: Job
    seen: List[Seen] = field(default_factory=list)
    #: Hang blocks and slow lines that came with no fault of theirs: (first line, time).
    false: List[str] = field(default_factory=list)
    slow: List[Tuple[int, float]] = field(default_factory=list)
    started: float = 0.0
    stderr: List[str] = field(default_factory=list)


def named_ranks(line: str) -> List[int]:
    """The ranks a hang's first line names as culprits."""
    match = re.match(r"tether: hang: ranks? ([0-9, -]+) (is|are) not", line)
    if not match:
        return []
    ranks: List[int] = []
    for span in match.group(1).split(","):
        low, _, high = span.strip().partition("-")
        ranks.extend(range(int(low), int(high or low) + 1))
    return ranks


def tether() -> str:
    return str(Path(sys.executable).with_name("tether"))


def _read(
    stream: "subprocess.IO[str]", name: str, lines: "queue.Queue[Tuple[float, str, str]]"
) -> None:
    for line in stream:
        lines.put((time.time(), name, line.rstrip("\n")))
    lines.put((time.time(), name, ""))


class Runner:
    """One job played."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.outcome = Outcome(job)
        plan = job.plan()
        env = dict(os.environ, WATCH_PLAN=plan, WATCH_STEP=str(job.step),
                   WATCH_JITTER=str(job.jitter), WATCH_STEPS=str(job.steps), **job.env)  # fmt: skip
        if job.slow:
            env["WATCH_FACTOR"] = str(job.slow[1])
        limit = 30 + job.steps * job.step * 1.5 + len(job.faults) * (job.expected_after() + 4)
        self.proc = subprocess.Popen(
            [tether(), "run", "-n", str(job.nproc), "--grace-period", "1",
             "--timeout", str(int(limit)), SCRIPT],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        self.lines: "queue.Queue[Tuple[float, str, str]]" = queue.Queue()
        self.readers = [
            threading.Thread(target=_read, args=(self.proc.stdout, "out", self.lines), daemon=True),
            threading.Thread(target=_read, args=(self.proc.stderr, "err", self.lines), daemon=True),
        ]
        for reader in self.readers:
            reader.start()
        self.pids: Dict[int, int] = {}
        self.current: Optional[Seen] = None
        self.block: Optional[Tuple[float, str]] = None

    def release(self, ended: bool = False) -> None:
        seen, self.current = self.current, None
        if seen is None:
            return
        pid = self.pids.get(seen.fault.rank)
        if seen.fault.kind == "collective" or ended or pid is None:
            self.proc.send_signal(signal.SIGTERM)
            return
        try:
            os.kill(pid, signal.SIGCONT if seen.fault.kind == "stop" else signal.SIGUSR2)
        except ProcessLookupError:
            pass

    def take(self, at: float, stream: str, line: str) -> None:
        out = self.outcome
        if stream == "err":
            out.stderr.append(line)
        text = line.split("]: ", 1)[1] if line.startswith("[rank ") else line
        words = text.split()
        if words[:1] == ["watch-ready"]:
            self.pids[int(words[1])] = int(words[2])
        elif words[:1] == ["watch-fault"]:
            kind, rank = words[1], int(words[2])
            fault = next((f for f in self.job.faults if (f.kind, f.rank) == (kind, rank) and
                          all(s.fault is not f for s in out.seen)), Fault(kind, rank))  # fmt: skip
            self.current = Seen(fault, float(words[4]))
            out.seen.append(self.current)
        elif text.startswith("tether: hang"):
            if self.current is not None and self.current.reported is None:
                self.current.reported = at
                self.current.named = named_ranks(text)
                self.release()
            else:
                out.false.append(text)
        elif text.startswith("tether: slow"):
            match = re.match(r"tether: slow: rank (\d+)", text)
            rank = int(match.group(1)) if match else -1
            if self.job.slow and rank == self.job.slow[0]:
                out.slow.append((rank, at - out.started))
            else:
                out.false.append(text)

    def play(self) -> Outcome:
        self.outcome.started = time.time()
        done = 0
        deadline = self.job.expected_after() + ALLOWANCE + 3
        while done < 2:
            try:
                at, stream, line = self.lines.get(timeout=0.1)
            except queue.Empty:
                at, stream, line = time.time(), "", None  # type: ignore[assignment]
            if line == "" and stream:
                done += 1
            elif line is not None:
                self.take(at, stream, line)
            if self.current is not None and time.time() > self.current.at + deadline:
                self.release()
        self.proc.wait(timeout=60)
        return self.outcome


def play(job: Job) -> Outcome:
    runner = Runner(job)
    try:
        return runner.play()
    finally:
        if runner.proc.poll() is None:
            runner.proc.kill()
            runner.proc.wait()


def hang_jobs() -> List[Job]:
    """Faults of every kind, at every rank, for 2, 3 and 4 ranks and three step times."""
    jobs = []
    for j, (nproc, step) in enumerate((n, s) for n in (2, 3, 4) for s in (0.05, 0.2, 0.6)):
        kinds = ["getitem", "lock", "stop", "spin", "getitem"]
        faults = [Fault(kind, (j + k) % nproc) for k, kind in enumerate(kinds)]
        faults.append(Fault("wait", 0))
        if nproc >= 3:
            faults[-2] = Fault("collective", (j + 1) % nproc or 1)
            faults[-1], faults[-2] = faults[-2], faults[-1]
        jobs.append(Job(nproc, step, faults, name=f"hangs-{nproc}x{step}"))
    return jobs


def slow_jobs() -> List[Job]:
    """A straggler at 1.3x and 2x, among 3 and 4 ranks."""
    return [
        Job(
            nproc,
            0.1,
            slow=(rank, factor),
            jitter=0.1,
            steps=int(24 / (0.1 * factor)),
            name=f"slow-{nproc}-{factor}",
        )  # fmt: skip
        for nproc, rank, factor in ((3, 1, 1.3), (4, 2, 1.3), (3, 2, 2.0), (4, 3, 2.0))
    ]


def healthy_jobs() -> List[Job]:
    """Healthy jobs: steps that vary by half, garbage-collection pauses, epochs that end in a
    validation on rank 0."""
    return [
        Job(3, 0.1, jitter=0.5, steps=120, name="healthy-jitter"),
        Job(4, 0.3, jitter=0.5, steps=40, name="healthy-long-steps"),
        Job(3, 0.05, jitter=0.5, steps=200, env={"WATCH_GC": "20"}, name="healthy-gc"),
        Job(2, 0.1, jitter=0.3, steps=120, env={"WATCH_EPOCH": "15"}, name="healthy-epochs"),
    ]
