"""``tether run``'s watch names a hang's culprit and a slow rank on its own, and keeps quiet
on healthy jobs: real gloo jobs on CPU (``watch_job.py``), faults injected at known steps
and released once reported (``watch_cases.py``). Each report must name the faulty rank
within ``max(2 s, 3 x step)`` and a small sampling allowance of the fault; precision and
recall are counted over at least sixty generated scenarios (the slow test), a few of them in
the quick one."""

from __future__ import annotations

import concurrent.futures
import os
from typing import List, Tuple

import pytest
import watch_cases
from watch_cases import ALLOWANCE, Fault, Job, Outcome, play

pytestmark = pytest.mark.timeout(600)


def score(outcomes: List[Outcome]) -> Tuple[int, int, int, List[str]]:
    """(true reports, false ones, scenarios) and one line per scenario: a hang is caught when
    its first report names its rank alone, in time; a straggler when its line came; a false
    report is one that names another rank or comes with no fault."""
    caught = false = scenarios = 0
    lines = []
    for out in outcomes:
        job = out.job
        limit = job.expected_after() + ALLOWANCE
        for seen in out.seen:
            scenarios += 1
            delay = seen.delay()
            right = seen.named == [seen.fault.rank]
            in_time = delay is not None and delay <= limit
            caught += right and in_time
            false += delay is not None and not right
            shown = "none" if delay is None else f"{delay:.2f} s"
            lines.append(f"{job.name} {seen.fault.kind} rank {seen.fault.rank}: {shown} "
                         f"(limit {limit:.2f} s), named {seen.named}")  # fmt: skip
        missing = [f for f in job.faults if all(s.fault is not f for s in out.seen)]
        scenarios += len(missing)
        lines.extend(f"{job.name} {f.kind} rank {f.rank}: the fault never came" for f in missing)
        if job.slow:
            scenarios += 1
            caught += bool(out.slow)
            lines.append(f"{job.name}: slow rank named at {out.slow}")
        elif not job.faults:
            scenarios += 1
            caught += not out.false
            lines.append(f"{job.name}: healthy, {len(out.false)} false report(s)")
        false += len(out.false)
        lines.extend(f"{job.name}: false: {line}" for line in out.false)
    return caught, false, scenarios, lines


def play_all(jobs: List[Job], at_once: int) -> List[Outcome]:
    with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
        return list(pool.map(play, jobs))


def check(outcomes: List[Outcome], least: int) -> None:
    caught, false, scenarios, lines = score(outcomes)
    print("\n".join(lines))
    precision = caught / max(caught + false, 1)
    recall = caught / max(scenarios, 1)
    print(f"{scenarios} scenarios: precision {precision:.3f}, recall {recall:.3f}")
    assert scenarios >= least
    assert precision >= 0.95 and recall >= 0.95, "\n".join(lines)


def test_a_rank_asleep_in_getitem_stopped_or_spinning_is_named_within_its_time() -> None:
    job = Job(3, 0.1, [Fault("getitem", 1), Fault("stop", 2), Fault("spin", 0)], name="quick")
    out = play(job)
    stderr = "\n".join(out.stderr)
    assert "rank 1 (pid" in stderr and "is in data loading: watch_job.py" in stderr, stderr
    assert "is stopped (SIGSTOP)" in stderr and "is busy at" in stderr, stderr
    check([out], 3)


def test_no_watch_turns_the_watch_off() -> None:
    job = Job(2, 0.1, [Fault("getitem", 1)], env={"PET_NO_WATCH": "1"}, name="no-watch")
    out = play(job)
    assert len(out.seen) == 1 and out.seen[0].reported is None
    assert not [line for line in out.stderr if line.startswith("tether: hang")]


@pytest.mark.slow
def test_sixty_generated_scenarios_are_named_with_precision_and_recall_of_095() -> None:
    jobs = watch_cases.hang_jobs() + watch_cases.slow_jobs() + watch_cases.healthy_jobs()
    # The longest first, two jobs at a time (the machine may have two cores only).
    jobs.sort(key=lambda job: -(len(job.faults) * 6 + job.steps * job.step))
    check(play_all(jobs, int(os.environ.get("WATCH_JOBS_AT_ONCE", "2"))), 60)
