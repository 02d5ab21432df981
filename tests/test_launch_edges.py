"""The launch layer at its edges, for every start method it concerns: any number of ranks,
resources running out, the caller's process attributes, join's timeouts, reports of any
size or shape, exit statuses taken by someone else, and a zygote that stops answering."""

from __future__ import annotations

import inspect
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import launch_ranks
import pytest

import tether
from tether import _native
from tether.common import reports
from tether.zygote import client

pytestmark = pytest.mark.timeout(180)

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture(autouse=True)
def _light_zygote():
    """The zygote of ``preload=[]`` these tests use is stopped after each of them."""
    yield
    client.get(()).close()


def options(method):
    """A start method, and for the zygote an empty preload (a light zygote)."""
    return {"start_method": method, "preload": [] if method == "forkserver" else None}


def run_script(*args, timeout=120):
    done = subprocess.run(
        [sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


# No limit below the system's ----------------------------------------------------------------------


@pytest.mark.slow  # a thousand processes: the longest start of the suite
@pytest.mark.parametrize("method", ["forkserver", "fork"])
def test_1000_ranks_in_one_call(method):
    flags = multiprocessing.get_context("spawn").Array("i", 1000, lock=False)
    tether.start_processes(launch_ranks.mark, args=(flags,), nprocs=1000, **options(method))
    assert list(flags) == list(range(1, 1001))


# Running out of anything leaves nothing behind ----------------------------------------------------


def _check_limit_result(result, errno):
    assert result["error"] is not None, "the start did not fail"
    kind, number, message = result["error"]
    assert number == errno, result["error"]
    assert "limit" in message, message
    assert result["stray"] == [], "children of the failed start were left"
    assert result["fds_after"] == result["fds_before"], result["extra"]
    assert result["second_start"]


def test_running_out_of_fds_leaves_nothing_behind(start_method):
    result = run_script(SCRIPTS / "limits.py", start_method, "nofile")
    _check_limit_result(result, 24)  # EMFILE
    assert "RLIMIT_NOFILE" in result["error"][2]


def _pids_cgroup():
    """A fresh pids cgroup (v1 or v2) this process may use, or None."""
    for root in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        if not os.access(os.path.join(root, "cgroup.procs"), os.W_OK):
            continue
        path = os.path.join(root, f"tether-test-{os.getpid()}-{time.monotonic_ns()}")
        try:
            os.mkdir(path)
        except OSError:
            continue
        if os.path.exists(os.path.join(path, "pids.max")):
            return path
        os.rmdir(path)
    return None


def test_running_out_of_processes_leaves_nothing_behind(start_method):
    if os.geteuid() != 0:
        result = run_script(SCRIPTS / "limits.py", start_method, "nproc")
    else:
        # RLIMIT_NPROC does not bind root: a pids cgroup makes fork fail the same way.
        cgroup = _pids_cgroup()
        assert cgroup is not None, "running as root without a pids cgroup to limit processes"
        try:
            result = run_script(SCRIPTS / "limits.py", start_method, "pids", cgroup)
        finally:
            deadline = time.monotonic() + 5
            while True:
                try:
                    os.rmdir(cgroup)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
    _check_limit_result(result, 11)  # EAGAIN
    assert "process limit" in result["error"][2]


# The caller's process attributes ------------------------------------------------------------------


def test_children_take_the_callers_umask_rlimits_affinity_and_more(start_method):
    result = run_script(SCRIPTS / "attributes.py", start_method)
    parent = result["parent"]
    assert parent["umask"] == "0077" and parent["core"] == [0, 0] and parent["nice"] >= 3
    for child in result["children"]:
        assert child.pop("file_mode") == "0o600"
        assert child == parent


# Timeouts as torch treats them --------------------------------------------------------------------


def nap(i, seconds):
    time.sleep(seconds)


def test_join_timeouts_as_torch_treats_them(start_method):
    ctx = tether.start_processes(nap, args=(0.6,), nprocs=2, join=False, **options(start_method))
    for bad, error in [(float("nan"), ValueError), ("1", TypeError), (None, None)]:
        if error is not None:
            with pytest.raises(error):
                ctx.join(bad)
            with pytest.raises(error):
                ctx.join(1.0, grace_period=bad)
    assert all(p.is_alive() for p in ctx.processes), "a bad argument stopped the children"
    start = time.monotonic()
    assert ctx.join(-0.1) is False
    assert ctx.join(0) is False
    assert ctx.join(False) is False  # a bool is a number of seconds, as for torch
    assert time.monotonic() - start < 0.5
    assert all(p.is_alive() for p in ctx.processes), "a negative timeout stopped the children"
    assert ctx.join(1e300) is True
    assert ctx.join(float("inf")) is True
    ctx = tether.start_processes(nap, args=(0.2,), nprocs=1, join=False, **options(start_method))
    assert ctx.join(float("inf")) is True
    assert [p.exitcode for p in ctx.processes] == [0]


# Every report arrives -----------------------------------------------------------------------------

BIG = 100 << 20


def raise_big(i):
    raise ValueError("x" * BIG)


def test_a_100_mb_exception_message_arrives_whole(start_method):
    with pytest.raises(tether.ProcessRaisedException) as info:
        tether.start_processes(raise_big, nprocs=1, **options(start_method))
    assert str(info.value).endswith("ValueError: " + "x" * BIG + "\n")
    assert isinstance(info.value.__context__, ValueError)
    assert len(info.value.__context__.args[0]) == BIG


class ReportingError(ValueError):
    """Says, while its report is being made, that rank 0 has begun reporting."""

    def __init__(self, message, started):
        super().__init__(message)
        self.started = started

    def __reduce__(self):
        self.started.set()
        time.sleep(0.2)  # rank 1 fails meanwhile; its SIGTERM must not cut this report
        return ValueError, self.args


def raise_big_or_exit(i, started):
    if i == 0:
        raise ReportingError("x" * BIG, started)
    started.wait(60)
    sys.exit(3)


def test_a_child_writing_its_report_is_never_signalled(start_method):
    started = multiprocessing.get_context("spawn").Event()
    ctx = tether.start_processes(
        raise_big_or_exit, args=(started,), nprocs=2, join=False, **options(start_method)
    )
    with pytest.raises(tether.ProcessException):
        while not ctx.join():
            pass
    # Rank 0 ended on its own once its report was written, not by tether's SIGTERM.
    assert ctx.processes[0].exitcode == 1


def test_a_report_beyond_the_limit_is_cut_with_a_note():
    body = b"Traceback (most recent call last):\n" + b"y" * 1000
    frame = _native.encode_report("builtins.ValueError", body, b"")
    text, cause = reports.decode(frame[:600])
    assert text.startswith("Traceback (most recent call last):\n")
    assert "report is incomplete" in text and "builtins.ValueError" in text
    assert cause is None


class UnpicklableExitError(Exception):
    def __reduce__(self):
        raise SystemExit("no pickling for you")


class UnpicklableInterruptError(Exception):
    def __reduce__(self):
        raise KeyboardInterrupt


def raise_unpicklable(i, kind):
    kinds = {"exit": UnpicklableExitError, "interrupt": UnpicklableInterruptError}
    raise kinds[kind]("the real error")


@pytest.mark.parametrize("kind", ["exit", "interrupt"])
def test_an_exception_whose_reduce_raises_still_reports_its_traceback(start_method, kind):
    with pytest.raises(tether.ProcessRaisedException) as info:
        tether.start_processes(raise_unpicklable, args=(kind,), nprocs=1, **options(start_method))
    assert "raise_unpicklable" in str(info.value)
    assert str(info.value).rstrip().endswith(": the real error")
    assert info.value.__cause__ is None and info.value.__context__ is None


# Statuses taken by someone else -------------------------------------------------------------------


@pytest.mark.parametrize("how", ["sigchld_ignored", "waitpid"])
def test_a_status_reaped_elsewhere_is_never_a_made_up_failure(start_method, how):
    result = run_script(SCRIPTS / "reaped_elsewhere.py", start_method, how)
    # Rank 1's real error is the one raised, whatever happened to rank 0's status.
    assert result["raised"] == ["ProcessRaisedException", 1], result
    assert "ValueError: rank 1 failed" in result["message"]
    assert result["rank0"] in ("exit code 0", "exit status unavailable (reaped outside tether)")
    if how == "sigchld_ignored":
        assert result["all_ok"] is True
        assert any("reaped outside tether" in w for w in result["warnings"]), result


# A quiet, bounded zygote --------------------------------------------------------------------------


def test_parent_death_leaves_no_zygote_output():
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "zygote_parent.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = json.loads(proc.stdout.readline())
    assert len(pids) >= 5  # three ranks, the zygote and its ready children
    proc.kill()
    out, err = proc.communicate(timeout=30)  # the pipes close once every holder is gone
    assert err == "", f"the zygote or its children wrote on the terminal: {err}"
    from conftest import wait_gone

    assert wait_gone(pids, 1.0) == []


def noop(i):
    pass


def test_a_stopped_zygote_fails_the_start_within_seconds_and_is_replaced():
    zygote = client.get(("json",))
    try:
        tether.start_processes(noop, nprocs=1, preload=("json",))
        old = zygote.pid
        os.kill(old, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(client.ZygoteError) as info:
            tether.start_processes(noop, nprocs=2, preload=("json",))
        assert time.monotonic() - start < 30
        assert f"pid {old}" in str(info.value) and "stopped" in str(info.value)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            tether.start_processes(noop, nprocs=2, preload=("json",))
        assert zygote.pid not in (None, old)
    finally:
        zygote.close()


# torch's constructors -----------------------------------------------------------------------------


def test_exceptions_take_exactly_torchs_constructor_arguments():
    torch_spawn = pytest.importorskip("torch.multiprocessing.spawn")
    for name in ("ProcessException", "ProcessRaisedException", "ProcessExitedException"):
        ours = inspect.signature(getattr(tether, name))
        theirs = inspect.signature(getattr(torch_spawn, name))
        assert list(ours.parameters) == list(theirs.parameters), name
    e = tether.ProcessException("m", error_index=0, error_pid=1)
    assert (e.msg, e.error_index, e.error_pid, e.pid) == ("m", 0, 1, 1)
    e = tether.ProcessRaisedException("m", error_index=2, error_pid=3)
    assert (e.error_index, e.error_pid) == (2, 3)
    e = tether.ProcessExitedException(
        "m", error_index=1, error_pid=5, exit_code=-9, signal_name="SIGKILL"
    )
    copy = pickle.loads(pickle.dumps(e))
    assert (copy.error_index, copy.error_pid, copy.exit_code, copy.signal_name) == (
        1,
        5,
        -9,
        "SIGKILL",
    )


# Errors from the native layer keep their errno ----------------------------------------------------


def test_native_errors_keep_their_errno():
    group = _native.Group()
    with pytest.raises(FileNotFoundError) as info:
        group.launch([_native.LaunchSpec([b"/nonexistent/tether-program"])])
    assert info.value.errno == 2 and "/nonexistent/tether-program" in str(info.value)


# What Python hands the native layer --------------------------------------------------------------


def test_the_values_a_child_is_handed_pickle_with_their_fields():
    for value, fields in [
        (_native.StacksChannel(7, 12345), {"fd": 7, "inode": 12345}),
        (_native.WorkerFds(5, 6), {"ctl": 5, "gate": 6}),
    ]:
        back = pickle.loads(pickle.dumps(value))
        assert type(back) is type(value)
        assert {name: getattr(back, name) for name in fields} == fields


def test_a_value_handed_to_the_native_layer_is_checked_where_it_is_made():
    spec = _native.LaunchSpec([b"prog", b"arg"], keep_fds=[3], payload=b"work")
    assert (spec.argv, spec.env, spec.keep_fds) == ([b"prog", b"arg"], [], [3])
    assert spec.payload == b"work"
    with pytest.raises(ValueError, match="NaN"):
        _native.Escalation(signal.SIGTERM, float("nan"))
    with pytest.raises(ValueError, match="invalid fd -1"):
        _native.Task(1, b"", [-1])
    with pytest.raises(ValueError, match="invalid fd -1"):
        _native.SharedFd(-1, 3)


# A working directory that was deleted ------------------------------------------------------------


def test_a_deleted_working_directory_is_an_error_that_says_so(start_method):
    result = run_script(SCRIPTS / "deleted_cwd.py", start_method)
    if start_method == "fork":
        # A fork child shares the deleted directory, as os.fork's does.
        assert result == {"start": None, "pool": None}, result
        return
    for what in ("start", "pool"):
        kind, message = result[what]
        assert kind == "FileNotFoundError", result
        assert "[Errno 2] the working directory of this process no longer exists" in message
        assert "change to a directory that exists" in message, message
