"""Cases that need a real parent process of their own: the parent killed with SIGKILL,
Ctrl-C in the parent, and a user's __main__ script."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from conftest import sigint_as_at_a_terminal, wait_gone

pytestmark = pytest.mark.timeout(90)

SCRIPTS = Path(__file__).parent / "scripts"
_started: List[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _stop_scripts():
    """A script a failed test left running is killed (its tether children die with it)."""
    yield
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def start_script(name: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / name), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_as_at_a_terminal,
    )
    _started.append(proc)
    return proc


def read_pids(proc: subprocess.Popen) -> List[int]:
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    return json.loads(line)


def test_parent_sigkill_takes_children_and_grandchildren(start_method):
    proc = start_script("parent_killed.py", start_method)
    try:
        pids = read_pids(proc)
        # Six children and grandchildren; with "forkserver" also the zygote and the children
        # it keeps ready.
        assert len(set(pids)) >= 7 if start_method == "forkserver" else len(set(pids)) == 6
    finally:
        proc.kill()
        proc.communicate()
    assert wait_gone(pids, 1.0) == [], "children outlived a parent killed with SIGKILL"


def test_ctrl_c_during_join_stops_every_child(start_method):
    proc = start_script("interrupted.py", start_method, "obedient")
    pids = read_pids(proc)
    time.sleep(0.3)  # into join()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert "alive after interrupt: [False, False]" in out
    assert err.rstrip().endswith("KeyboardInterrupt"), err
    assert proc.returncode != 0
    assert wait_gone(pids, 1.0) == []


def test_second_ctrl_c_kills_at_once():
    proc = start_script("interrupted.py", "spawn", "stubborn")
    pids = read_pids(proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None, "the parent did not wait for the SIGTERM grace period"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=10)
    assert "KeyboardInterrupt" in err
    assert wait_gone(pids, 1.0) == []


def tether_lines(err: str) -> List[str]:
    return [line for line in err.splitlines() if line.startswith("tether: ")]


def test_ctrl_c_in_join_says_how_children_stop_and_sigterms_those_deaf_to_sigint():
    proc = start_script("deaf_to_ctrl_c.py", "2", "default")
    pids = read_pids(proc)
    time.sleep(0.3)  # into join()
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    took = time.monotonic() - sent
    assert "exit codes: [-15, -15]" in out, err
    assert 2.9 <= took < 10, (took, err)
    assert tether_lines(err) == [
        "tether: Ctrl-C: forwarding SIGINT to 2 process(es); those still running 3 s later "
        "get SIGTERM, and SIGKILL 30 s after the Ctrl-C; press Ctrl-C again to kill them at "
        "once",
        "tether: 2 process(es) still running 3 s after SIGINT: SIGTERM; SIGKILL in 27 s",
    ]
    assert err.rstrip().endswith("KeyboardInterrupt"), err
    assert wait_gone(pids, 1.0) == []


def test_ctrl_c_in_join_kills_at_the_end_of_the_grace_period_what_ignores_sigterm():
    proc = start_script("deaf_to_ctrl_c.py", "3", "2")
    pids = read_pids(proc)
    time.sleep(0.3)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    took = time.monotonic() - sent
    assert "exit codes: [-15, -15, -9]" in out, err
    assert 1.9 <= took < 8, (took, err)
    assert tether_lines(err) == [
        "tether: Ctrl-C: forwarding SIGINT to 3 process(es); those still running 1 s later "
        "get SIGTERM, and SIGKILL 2 s after the Ctrl-C; press Ctrl-C again to kill them at "
        "once",
        "tether: 3 process(es) still running 1 s after SIGINT: SIGTERM; SIGKILL in 1 s",
        "tether: 1 process(es) still running at the end of the grace period (2 s): SIGKILL",
    ]
    assert wait_gone(pids, 1.0) == []


def test_functions_of_a_guarded_main_script(start_method):
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "main_guard.py"), start_method],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    main_name = "__main__" if start_method == "fork" else "__mp_main__"
    assert out.stdout.strip() == str([(0, 0, main_name), (1, 1, main_name), (2, 4, main_name)])


def test_a_script_without_the_main_guard_fails_clearly():
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "no_guard.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "parent done" not in out.stdout
    assert "ProcessRaisedException" in out.stderr
    assert "if __name__ == '__main__':" in out.stderr


@pytest.mark.parametrize("daemon", ["daemon", "nondaemon"])
def test_interpreter_exit_without_join(daemon):
    proc = start_script("exit_without_join.py", daemon)
    pids = read_pids(proc)
    out = proc.stdout.read()  # up to the parent's exit
    finished = time.monotonic()
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    main_done = float(out.split("main done at ")[1])
    if daemon == "daemon":
        assert finished - main_done < 20, "the parent waited for its daemonic children"
    else:
        # The children sleep 3 s from their start: however slow a loaded machine makes the
        # start of the second, the parent is left waiting for well over a second.
        assert finished - main_done >= 1.0, "the parent did not wait for its children"
    assert wait_gone(pids, 1.0) == []


def test_ctrl_c_outside_join_does_not_hang_at_exit():
    # Interrupted before join(): the interpreter exits on KeyboardInterrupt and stops the
    # (non-daemonic) children instead of waiting for them for ever.
    proc = start_script("interrupted.py", "forkserver", "obedient", "before-join")
    pids = read_pids(proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=20)
    assert "alive after interrupt" not in out and "KeyboardInterrupt" in err
    assert proc.returncode != 0
    assert wait_gone(pids, 1.0) == []
