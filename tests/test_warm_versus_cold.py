"""Warm ranks against new interpreters, on generated package/script pairs
(``warm_cases``): each pair runs under warm ``tether run``, under ``tether run --no-python
PYTHON -u`` (what torchrun runs, with tether's environment) and, for every fifth pair,
under torchrun, with 2 ranks and one restart (rank 0 fails once everything is recorded).
What every rank records in both attempts, and what it writes on stdout and stderr, is
compared; values a process draws for itself must differ between all ranks and attempts.

The packages are installed in a folder on ``PYTHONPATH`` that holds their ``.dist-info``
(as ``pip install --target`` makes it): installed packages, which the zygote preloads."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import warm_cases
from warm_cases import Case

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

PYTHON = sys.executable
TETHER = str(Path(PYTHON).with_name("tether"))
TORCHRUN = str(Path(PYTHON).with_name("torchrun"))
OPTIONS = ["--nproc-per-node", "2", "--max-restarts", "1"]
LAUNCHERS = {
    "warm": lambda script, out: [TETHER, "run", *OPTIONS, script, out],
    "python -u": lambda script, out: [
        *[TETHER, "run", *OPTIONS, "--no-python", PYTHON, "-u", script, out]
    ],
    "torchrun": lambda script, out: [TORCHRUN, *OPTIONS, script, out],
}
CASES = warm_cases.cases()
#: What differs between a launcher's ranks and another's by design: the tasks a compiled
#: library starts for itself (its threads start when first used in a warm rank).
NOT_COMPARED_WITH_TORCH = {"tasks"}


class Run:
    """One pair under one launcher: every rank's record by ``attempt.rank``, and its lines."""

    def __init__(self, records: Dict[str, Any], lines: Dict[str, List[str]], log: str) -> None:
        self.records = records
        self.lines = lines
        self.log = log


def launch(name: str, case: Case, where: Path, site: Path) -> Run:
    out = where / f"{case.name}.{name.split()[0]}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    script = str(where / f"{case.name}_script.py")
    env = dict(os.environ, PYTHONPATH=str(site), PKG_DIR=str(where / "pkg-dir"))
    for variable in ("OMP_NUM_THREADS", "PYTHONWARNINGS", "PKG_MODE"):
        env.pop(variable, None)
    proc = subprocess.run(
        LAUNCHERS[name](script, str(out)),
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    log = f"{name} of {warm_cases.describe(case)} (exit {proc.returncode}):\n{proc.stderr}"
    assert proc.returncode == 0, log
    records = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(records) == ["0.0", "0.1", "1.0", "1.1"], log
    return Run(records, rank_lines(proc.stdout + proc.stderr), log)


def rank_lines(text: str) -> Dict[str, List[str]]:
    """Each rank's lines (tether's own, such as its warnings, aside), by rank, in order."""
    lines: Dict[str, List[str]] = {}
    for line in text.splitlines():
        found = re.match(r"\[rank (\d+)\]: (.*)", line)
        if found:  # (numbers masked: a pid, a port, an address differ in any two runs)
            text = re.sub(r"\d+", "N", found.group(2))
            lines.setdefault(found.group(1), []).append(text)
    return lines


def comparable(record: Dict[str, Any], torch: bool) -> Dict[str, Any]:
    def clean(state: Dict[str, Any]) -> Dict[str, Any]:
        return {k: v for k, v in state.items() if not (torch and k in NOT_COMPARED_WITH_TORCH)}

    report = record["report"]
    if isinstance(report, dict):
        report = {k: v for k, v in report.items() if not k.startswith("unique_")}
    return {"before": clean(record["before"]), "after": clean(record["after"]), "report": report}


def uniques(run: Run) -> List[Tuple[str, Any]]:
    found = []
    for record in run.records.values():
        if isinstance(record["report"], dict):
            found += [(k, v) for k, v in record["report"].items() if k.startswith("unique_")]
    return found


def differences(case: Case, ours: Run, theirs: Run, lines: bool) -> List[str]:
    torch = any(b in warm_cases.TORCH_BEHAVIOURS for b in case.behaviours)
    found = []
    for key in sorted(theirs.records):
        a, b = comparable(ours.records[key], torch), comparable(theirs.records[key], torch)
        for part in a:
            if a[part] != b[part]:
                found.append(f"{key} {part}: {_diff(a[part], b[part])}")
    if lines:
        for rank in sorted(set(ours.lines) | set(theirs.lines)):
            if ours.lines.get(rank) != theirs.lines.get(rank):
                found.append(f"rank {rank} wrote {ours.lines.get(rank)} / {theirs.lines.get(rank)}")
    return found


def _diff(a: Any, b: Any) -> Any:
    """What differs between ``a`` (warm) and ``b``, in few words."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _diff(a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
    if isinstance(a, list) and isinstance(b, list) and all(isinstance(x, str) for x in a + b):
        if sorted(set(a)) != sorted(set(b)):
            return {"only warm": sorted(set(a) - set(b)), "only the other": sorted(set(b) - set(a))}
    return (a, b)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: Any) -> Dict[str, Dict[str, Run]]:
    """Every pair under its launchers (two at a time)."""
    where = tmp_path_factory.mktemp("warm-versus-cold")
    site = where / "site"
    (where / "pkg-dir").mkdir()
    for case in CASES:
        warm_cases.write_package(site, case)
        warm_cases.write_script(where, case)
    jobs = [(case, name) for i, case in enumerate(CASES) for name in LAUNCHERS
            if name != "torchrun" or i % 5 == 0]
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda job: launch(job[1], job[0], where, site), jobs))
    found: Dict[str, Dict[str, Run]] = {}
    for (case, name), run in zip(jobs, done):
        found.setdefault(case.name, {})[name] = run
    return found


def test_there_are_at_least_150_generated_pairs() -> None:
    assert len(CASES) >= 150
    assert len({(c.behaviours, c.variant) for c in CASES}) == len(CASES)
    assert {c.variant for c in CASES} == set(warm_cases.VARIANTS)


def test_a_warm_rank_sees_what_python_dash_u_sees_in_every_pair(runs) -> None:
    failures = []
    for case in CASES:
        found = differences(case, runs[case.name]["warm"], runs[case.name]["python -u"], True)
        if found:
            failures.append(f"{warm_cases.describe(case)}:\n  " + "\n  ".join(found))
    assert not failures, "\n".join(failures)


def test_a_warm_rank_sees_what_a_torchrun_rank_sees(runs) -> None:
    failures = []
    for case in CASES:
        theirs = runs[case.name].get("torchrun")
        if theirs is not None:
            found = differences(case, runs[case.name]["warm"], theirs, False)
            if found:
                failures.append(f"{warm_cases.describe(case)}:\n  " + "\n  ".join(found))
    assert not failures, "\n".join(failures)


def test_what_each_process_draws_differs_between_ranks_and_attempts(runs) -> None:
    for case in CASES:
        for name, run in runs[case.name].items():
            drawn = uniques(run)
            values = [json.dumps(v) for _, v in drawn]
            assert len(values) == len(set(values)), (name, warm_cases.describe(case), drawn)
