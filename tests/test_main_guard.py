"""A script that starts a pool without ``if __name__ == "__main__":`` fails at once with an
error that names the guard and the script's line, as a file and through IPython's ``%run``,
while a ``__main__`` without a file (``python -c``, stdin) keeps working. Each program runs
in a fresh interpreter, in a private temporary folder."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

import pytest

#: The guard, as the error must spell it.
GUARD = 'if __name__ == "__main__":'

#: Starts a pool at the script's top level, timing the start that fails.
UNGUARDED_POOL = """\
import time
import tether

def square(x):
    return x * x

started = time.monotonic()
try:
    pool = tether.Pool(2, start_method={method!r})
except tether.BrokenPool as error:
    print(f"raised after {{time.monotonic() - started:.3f}} s", flush=True)
    raise
print(list(pool.map(square, range(4))))
pool.shutdown()
"""

#: The same start under a condition (whether a worker runs it depends on the condition).
CONDITIONAL_POOL = """\
import sys
import time
import tether

def square(x):
    return x * x

started = time.monotonic()
if sys.argv:
    try:
        pool = tether.Pool(2, start_method={method!r})
    except tether.BrokenPool:
        print(f"raised after {{time.monotonic() - started:.3f}} s", flush=True)
        raise
    print(list(pool.map(square, range(4))))
    pool.shutdown()
"""

#: Makes an executor at the top level (which starts nothing, as CPython's does) and submits
#: a task there (line 8), which starts its first worker.
UNGUARDED_EXECUTOR = """\
import tether

def square(x):
    return x * x

executor = tether.ProcessPoolExecutor(2, mp_context={method!r})
try:
    future = executor.submit(square, 3)
    print(future.result(timeout=60))
finally:
    executor.shutdown()
"""

#: A module-level executor is fine as long as it starts its workers under the guard.
GUARDED_EXECUTOR = """\
import tether

executor = tether.ProcessPoolExecutor(2)

def square(x):
    return x * x

if __name__ == "__main__":
    print(list(executor.map(square, range(4))))
    executor.shutdown()
"""

#: A program without a file: its functions travel by value, nothing is imported again.
NO_FILE = """\
import tether

def square(x):
    return x * x

with tether.Pool(2) as pool:
    print(list(pool.map(square, range(4))))
"""


def _run(
    argv: list, folder: Path, stdin: Optional[str] = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, input=stdin, capture_output=True, text=True, timeout=timeout, cwd=folder
    )


def _write(folder: Path, text: str) -> Path:
    script = folder / "train.py"
    script.write_text(textwrap.dedent(text))
    return script


def _says_the_guard(stderr: str, where: str, line: str) -> None:
    assert "BrokenPool: " in stderr, stderr
    said = stderr.rsplit("BrokenPool: ", 1)[1]
    assert GUARD in said and where in said and f"(`{line}`)" in said, stderr
    assert "Traceback" not in said, stderr  # the error alone, no worker's traceback


def _line_of(script: Path, text: str) -> str:
    """``file:line`` of the first line of ``script`` that holds ``text``."""
    lines = script.read_text().splitlines()
    return f"{script}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
@pytest.mark.parametrize("first", ["", "import torch\n"], ids=["plain", "torch-first"])
def test_a_script_that_starts_a_pool_without_the_main_guard_says_so_at_once(
    tmp_path, method, first
):
    # The statement runs whatever happens: the parent says so before any worker starts,
    # however long a worker would take to import the script up to there.
    script = _write(tmp_path, first + UNGUARDED_POOL.format(method=method))
    out = _run([sys.executable, str(script)], tmp_path)
    assert out.returncode == 1 and "[0, 1, 4, 9]" not in out.stdout, out.stdout + out.stderr
    line = f"pool = tether.Pool(2, start_method={method!r})"
    _says_the_guard(out.stderr, _line_of(script, line), line)
    assert "before any worker started" in out.stderr, out.stderr
    seconds = float(out.stdout.split("raised after ")[1].split()[0])
    assert seconds < 1, out.stdout


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_pool_started_under_a_condition_is_named_by_the_worker_that_reaches_it(
    tmp_path, method
):
    # Whether a worker runs it depends on the condition there: the worker tells.
    script = _write(tmp_path, CONDITIONAL_POOL.format(method=method))
    out = _run([sys.executable, str(script)], tmp_path)
    assert out.returncode == 1 and "[0, 1, 4, 9]" not in out.stdout, out.stdout + out.stderr
    line = f"pool = tether.Pool(2, start_method={method!r})"
    _says_the_guard(out.stderr, _line_of(script, line), line)
    assert "stopped there" in out.stderr, out.stderr
    seconds = float(out.stdout.split("raised after ")[1].split()[0])
    assert seconds < 10, out.stdout  # before, the parent waited for nested pools


def test_an_executor_made_without_the_guard_says_so_at_its_first_submit(tmp_path):
    script = _write(tmp_path, UNGUARDED_EXECUTOR.format(method="forkserver"))
    out = _run([sys.executable, str(script)], tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    _says_the_guard(out.stderr, f"{script}:8", "future = executor.submit(square, 3)")
    assert "before any worker started" in out.stderr, out.stderr


def test_an_executor_whose_first_submit_is_under_a_condition_says_so_as_cpython(tmp_path):
    conditional = UNGUARDED_EXECUTOR.format(method="forkserver").replace(
        "    future = executor.submit", "    if executor:\n        future = executor.submit"
    )
    script = _write(tmp_path, conditional)
    out = _run([sys.executable, str(script)], tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    _says_the_guard(out.stderr, f"{script}:9", "future = executor.submit(square, 3)")
    assert "A child process terminated abruptly" in out.stderr  # CPython's words first


def test_an_executor_made_at_the_top_level_works_when_it_starts_under_the_guard(tmp_path):
    script = _write(tmp_path, GUARDED_EXECUTOR)
    out = _run([sys.executable, str(script)], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0, 1, 4, 9]"


def test_ipythons_run_of_a_script_without_the_guard_says_so(tmp_path):
    script = _write(tmp_path, UNGUARDED_POOL.format(method="forkserver"))
    code = f"%run {script}"
    ipython = [sys.executable, "-m", "IPython", "--colors=NoColor", "--no-banner", "-c", code]
    out = _run(ipython, tmp_path)
    said = out.stdout + out.stderr
    assert "[0, 1, 4, 9]" not in said, said
    _says_the_guard(said, f"{script}:9", "pool = tether.Pool(2, start_method='forkserver')")


@pytest.mark.parametrize("way", ["python -c", "stdin"])
def test_a_program_without_a_file_starts_a_pool_without_the_guard(tmp_path, way):
    if way == "python -c":
        out = _run([sys.executable, "-c", NO_FILE], tmp_path)
    else:
        out = _run([sys.executable, "-"], tmp_path, stdin=NO_FILE)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0, 1, 4, 9]"
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize(
    "source, line, runs",
    [
        ("import tether\npool = tether.Pool(2)\n", 2, True),
        ("with open('f') as f:\n    pass\n", 1, True),  # a with statement's own line
        ("with open('f') as f:\n    x = 1\n    y = 2\n", 3, True),
        ("try:\n    x = 1\nexcept OSError:\n    y = 2\nfinally:\n    z = 3\n", 2, True),
        ("try:\n    x = 1\nexcept OSError:\n    y = 2\nfinally:\n    z = 3\n", 6, True),
        ("try:\n    x = 1\nexcept OSError:\n    y = 2\n", 4, False),
        ("try:\n    x = 1\nexcept OSError:\n    y = 2\nelse:\n    z = 3\n", 6, False),
        ('if __name__ == "__main__":\n    x = 1\n', 2, False),
        ("for i in range(3):\n    x = i\n", 2, False),
        ("while False:\n    x = 1\n", 2, False),
        ("with open('f'):\n    if x:\n        y = 1\n", 3, False),
        ("x = (\n    1,\n)\n", 2, True),  # a statement over several lines
        ("def f(\n", 1, False),  # does not parse: left to the workers
    ],
)
def test_which_top_level_statements_run_whenever_the_script_runs(tmp_path, source, line, runs):
    from tether.pool import guard

    script = tmp_path / "script.py"
    script.write_text(source)
    assert guard._unguarded(str(script), line) is runs


def test_an_executor_reads_the_script_only_until_its_first_worker_starts(monkeypatch):
    # Afterwards that worker's import of the script ran every statement the check would
    # name: reading the script again at each submit would only slow submit down.
    import tether
    from tether.pool import guard

    calls = []
    real = guard.unguarded_start
    monkeypatch.setattr(guard, "unguarded_start", lambda *a: calls.append(a) or real(*a))
    executor = tether.ProcessPoolExecutor(4)
    try:
        assert [executor.submit(abs, -i).result(timeout=60) for i in range(20)] == list(range(20))
        assert executor._core.started < 4  # workers start on demand: the check was still asked
    finally:
        executor.shutdown()
    assert len(calls) == 1
