"""tether.spawn / start_processes / ProcessContext: every case of torch's own spawn tests,
and what tether promises beyond them. Each test runs with every start method."""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import tether
from conftest import stray_children, wait_gone

pytestmark = pytest.mark.timeout(60)


def start(fn, args=(), nprocs=2, start_method="spawn", **kwargs):
    return tether.start_processes(fn, args=args, nprocs=nprocs, start_method=start_method, **kwargs)


# Functions run in the children ------------------------------------------------------------


def success(i):
    pass


def put_index(i, queue):
    queue.put(i)


def put_parent(i, queue):
    parent = multiprocessing.parent_process()
    queue.put(None if parent is None else (parent.name, parent.pid, parent.is_alive()))


def raise_in(i, rank):
    if i == rank:
        raise ValueError("legitimate exception from process %d" % i)
    time.sleep(1.0)


def raise_all(i):
    time.sleep(random.random() / 10)
    raise ValueError("legitimate exception from process %d" % i)


def abort_rank0(i):
    if i == 0:
        # A fork child inherits pytest's fault handler, which writes past pytest's capture:
        # point it at the child's stderr (captured), where the test looks for its dump.
        faulthandler.enable(file=sys.stderr)
        os.kill(os.getpid(), signal.SIGABRT)
    time.sleep(1.0)


def exit_rank0(i, code):
    if i == 0:
        sys.exit(code)
    time.sleep(1.0)


def success_first_then_exception(i, arg):
    if i == 0:
        return
    time.sleep(0.1)
    raise ValueError("legitimate exception")


def sleep_forever(i):
    while True:
        time.sleep(1)


def exit_12(i):
    sys.exit(12)


def fail_at(i, delays):
    time.sleep(delays[i])
    raise RuntimeError(f"rank {i} failed")


def raise_keyboard_interrupt(i):
    raise KeyboardInterrupt


class UnpicklableError(Exception):
    def __init__(self, msg):
        super().__init__(msg)
        self.lock = threading.Lock()


class NeedsTwoArgsError(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


def raise_unpicklable(i):
    raise UnpicklableError("cannot pickle me")


def raise_needs_args(i):
    raise NeedsTwoArgsError("first", "second")


def raise_huge(i):
    raise ValueError("x" * (8 << 20) + "END")


def use_primitives(i, simple, queue, event, lock, value):
    with lock:
        value.value += i + 1
    simple.put(("simple", i))
    queue.put(("queue", i))
    if i == 0:
        event.set()


def nested_spawn(i, start_method, queue):
    tether.start_processes(put_index, args=(queue,), nprocs=2, start_method=start_method)


def nested_then_die(i, pids_queue, ready, start_method):
    ctx = tether.start_processes(
        put_index, args=(ready,), nprocs=2, join=False, start_method=start_method
    )
    for _ in range(2):
        ready.get()
    pids_queue.put(ctx.pids())
    # Children started with put_index are done; start two that would live for ever.
    ctx2 = tether.start_processes(sleep_forever, nprocs=2, join=False, start_method=start_method)
    pids_queue.put(ctx2.pids())
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGTERM)


# torch's own spawn tests ---------------------------------------------------------------


def test_success(start_method):
    assert start(success, start_method=start_method) is None


def test_success_non_blocking(start_method):
    ctx = start(success, join=False, start_method=start_method)
    ctx.join(timeout=None)
    ctx.join(timeout=None)
    assert ctx.join(timeout=None) is True


def exit_after(i, delays):
    time.sleep(delays[i])


def test_sentinels_and_process_attributes_as_torch_and_multiprocessing_have_them(start_method):
    ctx = start(exit_after, args=((0.0, 30.0),), join=False, start_method=start_method)
    first, second = ctx.processes
    assert second.ident == second.pid
    first.join(30)
    assert ctx.sentinels == {second.sentinel: 1}, "a finished rank is no longer waited on"
    with pytest.raises(ValueError):
        second.close()
    second.kill()
    with pytest.raises(tether.ProcessExitedException):
        ctx.join(30)
    assert ctx.sentinels == {}
    first.close()


def test_first_argument_index(start_method):
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    start(put_index, args=(queue,), start_method=start_method)
    assert sorted([queue.get(), queue.get()]) == [0, 1]


def test_a_child_knows_its_parent_process_as_multiprocessings_children_do(start_method):
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    start(put_parent, args=(queue,), start_method=start_method)
    me = (multiprocessing.current_process().name, os.getpid(), True)
    assert [queue.get(), queue.get()] == [me, me]


@pytest.mark.parametrize("rank", [0, 1])
def test_exception_single(start_method, rank):
    with pytest.raises(
        Exception, match=r"\nValueError: legitimate exception from process %d$" % rank
    ):
        start(raise_in, args=(rank,), start_method=start_method)


def test_exception_all(start_method):
    with pytest.raises(Exception, match=r"\nValueError: legitimate exception from process (0|1)$"):
        start(raise_all, start_method=start_method)


def test_terminate_signal(start_method, capfd):
    with pytest.raises(Exception, match="process 0 terminated with signal (SIGABRT|SIGIOT)"):
        start(abort_rank0, start_method=start_method)
    dump = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in dump and "in abort_rank0" in dump


def test_terminate_exit(start_method):
    with pytest.raises(Exception, match="process 0 terminated with exit code 123") as info:
        start(exit_rank0, args=(123,), start_method=start_method)
    assert info.value.exit_code == 123
    assert stray_children() == set()


def test_success_first_then_exception(start_method):
    with pytest.raises(Exception, match="ValueError: legitimate exception"):
        start(success_first_then_exception, args=(123,), start_method=start_method)


def test_exception_raises(start_method):
    with pytest.raises(tether.ProcessRaisedException):
        start(success_first_then_exception, nprocs=1, start_method=start_method)


def test_missing_arguments_raise_in_the_child(start_method):
    with pytest.raises(tether.ProcessRaisedException, match="TypeError"):
        start(exit_rank0, args=(), start_method=start_method)


def test_signal_raises(start_method):
    ctx = start(sleep_forever, nprocs=1, join=False, start_method=start_method)
    for pid in ctx.pids():
        os.kill(pid, signal.SIGTERM)
    with pytest.raises(tether.ProcessExitedException) as info:
        ctx.join()
    assert info.value.signal_name == "SIGTERM"
    assert info.value.exit_code == -signal.SIGTERM


def test_process_exited(start_method):
    with pytest.raises(tether.ProcessExitedException) as info:
        start(exit_12, nprocs=1, start_method=start_method)
    assert info.value.exit_code == 12
    assert info.value.signal_name is None


def test_exceptions_pickle():
    raised = tether.ProcessRaisedException("msg", 1, 1234)
    exited = tether.ProcessExitedException("msg", 2, 4321, exit_code=-9, signal_name="SIGKILL")
    for e in (raised, exited):
        copy = pickle.loads(pickle.dumps(e))
        assert type(copy) is type(e)
        assert (copy.msg, copy.error_index, copy.pid, copy.error_pid) == (
            e.msg,
            e.error_index,
            e.pid,
            e.pid,
        )
    copy = pickle.loads(pickle.dumps(exited))
    assert (copy.exit_code, copy.signal_name) == (-9, "SIGKILL")


def test_nested_children_die_with_their_parent(start_method):
    mp = multiprocessing.get_context("spawn")
    pids_queue, ready = mp.Queue(), mp.Queue()
    ctx = start(
        nested_then_die,
        args=(pids_queue, ready, start_method),
        nprocs=1,
        join=False,
        start_method=start_method,
    )
    first, second = pids_queue.get(timeout=30), pids_queue.get(timeout=30)
    with pytest.raises(tether.ProcessExitedException, match="signal SIGTERM"):
        ctx.join()
    assert wait_gone(first + second, 1.0) == []


# Beyond torch ---------------------------------------------------------------------------


def test_pid_and_error_pid_are_both_set(start_method):
    with pytest.raises(tether.ProcessRaisedException) as info:
        start(raise_in, args=(1,), start_method=start_method)
    e = info.value
    assert e.error_index == 1
    assert e.pid == e.error_pid and e.pid > 0


def test_original_exception_is_the_suppressed_context(start_method):
    with pytest.raises(tether.ProcessRaisedException) as info:
        start(raise_in, args=(0,), nprocs=1, start_method=start_method)
    cause = info.value.__context__
    assert isinstance(cause, ValueError) and info.value.__suppress_context__
    assert str(cause) == "legitimate exception from process 0"


def test_the_failing_rank_example_shows_the_exception_rebuilt_in_the_parent():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    example = os.path.join(root, "examples", "failing_rank.py")
    got = subprocess.run([sys.executable, example], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert (
        "the original exception, rebuilt in the parent: "
        "ValueError('rank 2: loss became NaN at step 3')"
    ) in got.stdout


def test_a_ranks_exception_prints_each_of_its_lines_once(tmp_path):
    script = tmp_path / "raises.py"
    script.write_text(
        "import tether\n"
        "def train(rank):\n"
        "    raise ValueError(f'rank {rank} diverged')\n"
        "if __name__ == '__main__':\n"
        "    tether.spawn(train, nprocs=1)\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and lines[-1] == "ValueError: rank 0 diverged", proc.stderr
    assert proc.stderr.count("ValueError: rank 0 diverged") == 1, proc.stderr
    assert "direct cause" not in proc.stderr and "During handling" not in proc.stderr
    assert all(a != b for a, b in zip(lines, lines[1:])), proc.stderr


def test_unpicklable_exception_still_gives_the_traceback(start_method):
    with pytest.raises(tether.ProcessRaisedException) as info:
        start(raise_unpicklable, nprocs=1, start_method=start_method)
    assert re.search(r"\nUnpicklable: cannot pickle me$", str(info.value)) or re.search(
        r"UnpicklableError: cannot pickle me\n$", str(info.value)
    )
    assert "raise_unpicklable" in str(info.value)
    assert info.value.__context__ is None


def test_exception_whose_constructor_needs_arguments(start_method):
    with pytest.raises(tether.ProcessRaisedException) as info:
        start(raise_needs_args, nprocs=1, start_method=start_method)
    assert "NeedsTwoArgsError: first and second" in str(info.value)
    assert "raise_needs_args" in str(info.value)


def test_huge_traceback_arrives_whole(start_method):
    with pytest.raises(tether.ProcessRaisedException) as info:
        start(raise_huge, nprocs=1, start_method=start_method)
    text = str(info.value)
    assert len(text) > 8 << 20
    assert text.rstrip().endswith("xxxxEND")


def test_keyboard_interrupt_in_a_child_is_a_failure(start_method):
    with pytest.raises(tether.ProcessRaisedException, match="KeyboardInterrupt"):
        start(raise_keyboard_interrupt, nprocs=1, start_method=start_method)


def test_root_cause_is_first_in_time_even_outside_join(start_method):
    # Rank 2 fails first, rank 0 later; the parent only joins after both have failed.
    ctx = start(fail_at, args=([0.6, 30.0, 0.05],), nprocs=3, join=False, start_method=start_method)
    time.sleep(1.2)
    with pytest.raises(tether.ProcessRaisedException, match="rank 2 failed") as info:
        ctx.join()
    assert info.value.error_index == 2
    assert not any(p.is_alive() for p in ctx.processes)


def test_no_temporary_files_are_left(start_method):
    before = set(os.listdir(tempfile.gettempdir()))
    for _ in range(2):
        with pytest.raises(tether.ProcessRaisedException):
            start(raise_all, start_method=start_method)
    assert set(os.listdir(tempfile.gettempdir())) == before


def test_multiprocessing_primitives_as_arguments(start_method):
    mp = multiprocessing.get_context("spawn")
    simple, queue, event, lock = mp.SimpleQueue(), mp.Queue(), mp.Event(), mp.Lock()
    value = mp.Value("i", 0)
    start(use_primitives, args=(simple, queue, event, lock, value), start_method=start_method)
    assert sorted([simple.get(), simple.get()]) == [("simple", 0), ("simple", 1)]
    assert sorted([queue.get(timeout=10), queue.get(timeout=10)]) == [("queue", 0), ("queue", 1)]
    assert event.is_set()
    assert value.value == 3
    queue.close()
    queue.join_thread()


def test_nested_spawn(start_method):
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    start(nested_spawn, args=(start_method, queue), nprocs=1, start_method=start_method)
    assert sorted([queue.get(), queue.get()]) == [0, 1]


def test_process_objects(start_method):
    ctx = start(sleep_forever, nprocs=2, join=False, start_method=start_method)
    p0, p1 = ctx.processes
    assert ctx.pids() == [p0.pid, p1.pid]
    assert p0.is_alive() and p0.exitcode is None
    assert multiprocessing.connection.wait([p0.sentinel, p1.sentinel], timeout=0.05) == []
    p0.terminate()
    p0.join(timeout=10)
    assert not p0.is_alive() and p0.exitcode == -signal.SIGTERM
    assert multiprocessing.connection.wait([p0.sentinel, p1.sentinel], timeout=5) == [p0.sentinel]
    p1.kill()
    p1.join()
    assert p1.exitcode == -signal.SIGKILL


def test_join_timeout_returns_false_while_running(start_method):
    ctx = start(sleep_forever, nprocs=1, join=False, start_method=start_method)
    assert ctx.join(timeout=0.05) is False
    ctx.processes[0].kill()
    with pytest.raises(tether.ProcessExitedException, match="signal SIGKILL") as info:
        ctx.join()
    assert any("OOM" in note for note in info.value.__notes__)


def test_grace_period_then_sigkill(start_method):
    ctx = start(fail_at, args=([0.05, 60.0],), nprocs=2, join=False, start_method=start_method)
    begin = time.monotonic()
    with pytest.raises(tether.ProcessRaisedException, match="rank 0 failed"):
        ctx.join(grace_period=0.2)
    assert time.monotonic() - begin < 10
    assert ctx.processes[1].exitcode == -signal.SIGTERM


def test_spawn_from_a_short_lived_thread(start_method):
    box = {}
    thread = threading.Thread(
        target=lambda: box.setdefault(
            "ctx", start(success_after, args=(0.5,), join=False, start_method=start_method)
        )
    )
    thread.start()
    thread.join()
    ctx = box["ctx"]
    time.sleep(0.2)
    assert all(p.is_alive() for p in ctx.processes)
    assert ctx.join() is True


def success_after(i, delay):
    time.sleep(delay)


def test_unknown_start_method_is_a_value_error():
    with pytest.raises(ValueError, match="unknown start method 'threads'"):
        tether.start_processes(success, nprocs=1, start_method="threads")


def test_bad_nprocs_is_a_value_error():
    with pytest.raises(ValueError, match="nprocs"):
        tether.start_processes(success, nprocs=-1)


def test_spawn_warns_about_another_start_method():
    with pytest.warns(FutureWarning, match="start_method='fork'"):
        tether.spawn(success, nprocs=1, start_method="fork")


def test_zero_processes():
    ctx = tether.start_processes(success, nprocs=0, join=False)
    assert ctx.pids() == [] and ctx.join() is True


def test_import_does_not_import_torch():
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", "import sys, tether; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"


def test_import_leaves_the_pools_machinery_until_a_pool_needs_it():
    import subprocess

    code = (
        "import sys, tether, tether.errors as e; "
        "print('concurrent.futures.process' in sys.modules); "
        "import concurrent.futures.process as p; "
        "print(issubclass(e.WorkerCrashedError, p.BrokenProcessPool), "
        "tether.BrokenPool is e.BrokenPool)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "True"], out.stdout
