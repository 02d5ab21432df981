"""``tether.Pool`` as a ``concurrent.futures.Executor``: what CPython's own executor tests
and loky's crash matrix check, as tether does it.

Where tether differs on purpose: a worker that dies fails the task it was running with
``WorkerCrashedError`` (a ``BrokenProcessPool``) and the pool heals, instead of the whole
pool breaking; a task or result that fails to pickle or unpickle fails that task with the
original exception, and the worker lives on."""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from concurrent.futures.process import BrokenProcessPool, _RemoteTraceback

import pool_cases
import pool_helpers as helpers
import pytest

import tether
from conftest import sigint_as_at_a_terminal, wait_gone

pytestmark = pytest.mark.timeout(120)

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def pool():
    with tether.Pool(2) as pool:
        yield pool


@pytest.fixture
def fresh():
    """A pool of its own, for tests that kill workers (a replaced worker is a new child)."""
    with tether.Pool(2) as pool:
        yield pool


def _run_script(body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


# -- results and exceptions ---------------------------------------------------------------------


def test_submit_result_and_exception_with_the_workers_traceback(pool):
    assert pool.submit(helpers.add, 2, b=3).result(timeout=30) == 5
    assert pool.submit(helpers.capture, 1, self=2, fn=3).result(timeout=30) == (
        (1,),
        {"self": 2, "fn": 3},
    )
    with pytest.raises(TypeError):
        pool.submit(fn=helpers.capture)  # type: ignore[call-arg]
    future = pool.submit(helpers.raise_runtime_error)
    with pytest.raises(RuntimeError) as info:
        future.result(timeout=30)
    assert info.value.args == (123,)
    cause = info.value.__cause__
    assert type(cause) is _RemoteTraceback  # the class concurrent.futures uses
    assert "raise RuntimeError(123)  # the line the remote traceback shows" in cause.tb
    assert isinstance(future, concurrent.futures.Future)
    assert isinstance(pool, concurrent.futures.Executor)


def test_an_exception_that_cannot_cross_is_named_with_its_message_and_traceback(pool):
    for fn, type_name, message in [
        (helpers.raise_needs_two, "NeedsTwoArgumentsError", "first"),
        (helpers.raise_holds_a_lock, "HoldsALockError", "locked out"),
    ]:
        with pytest.raises(tether.RemoteError) as info:
            pool.submit(fn).result(timeout=30)
        error = info.value
        assert error.type_name == type_name and error.message == message
        assert f"{type_name}: {message}" in str(error)
        assert fn.__name__ in error.traceback
        assert fn.__name__ in info.value.__cause__.tb
        assert pickle.loads(pickle.dumps(error)).type_name == type_name


def test_task_pickling_errors_reach_the_caller_as_themselves(pool):
    future = pool.submit(helpers.identity, helpers.ErrorAtPickle())
    with pytest.raises(ValueError, match="error while pickling"):
        future.result(timeout=30)
    future = pool.submit(helpers.identity, helpers.ExitAtPickle())
    with pytest.raises(SystemExit) as info:
        future.result(timeout=30)
    assert info.value.code == 5
    assert pool.submit(helpers.square, 3).result(timeout=30) == 9


@pytest.mark.parametrize(
    "bad, error, where",
    [
        (helpers.ExitAtUnpickle, SystemExit, "_exit_at_unpickle"),
        (helpers.ErrorAtUnpickle, ValueError, "_error_at_unpickle"),
    ],
)
def test_task_unpickling_errors_in_the_worker_are_the_original_exception(pool, bad, error, where):
    pids = pool.pids()
    with pytest.raises(error) as info:
        pool.submit(helpers.identity, bad()).result(timeout=30)
    assert where in info.value.__cause__.tb
    assert pool.pids() == pids  # the worker survived


@pytest.mark.parametrize(
    "kind, error",
    [("ErrorAtPickle", ValueError), ("ExitAtPickle", SystemExit), ("unpicklable", TypeError)],
)
def test_result_pickling_errors_in_the_worker_are_the_original_exception(pool, kind, error):
    fn, args = (
        (helpers.unpicklable_result, ()) if kind == "unpicklable" else (helpers.make, (kind,))
    )
    with pytest.raises(error) as info:
        pool.submit(fn, *args).result(timeout=30)
    assert type(info.value.__cause__) is _RemoteTraceback


@pytest.mark.parametrize(
    "kind, error", [("ErrorAtUnpickle", ValueError), ("ExitAtUnpickle", SystemExit)]
)
def test_result_unpickling_errors_here_are_the_original_exception(pool, kind, error):
    with pytest.raises(error):
        pool.submit(helpers.make, kind).result(timeout=30)
    assert pool.submit(helpers.square, 5).result(timeout=30) == 25


def test_task_sys_exit_is_its_result(pool):
    with pytest.raises(SystemExit):
        pool.submit(sys.exit, 3).result(timeout=30)


# -- map ------------------------------------------------------------------------------------


def test_map_in_order_with_chunks(pool):
    assert list(pool.map(helpers.square, range(1000))) == [i * i for i in range(1000)]
    assert list(pool.map(pow, range(40), range(40), chunksize=6)) == list(
        map(pow, range(40), range(40))
    )
    assert list(pool.map(pow, range(40), range(40), chunksize=50)) == list(
        map(pow, range(40), range(40))
    )
    with pytest.raises(ValueError):
        list(pool.map(helpers.square, range(3), chunksize=0))


def test_map_raises_at_the_failing_item_and_times_out(pool):
    results = pool.map(divmod, [1, 1, 1, 1], [2, 3, 0, 5])
    assert next(results) == (0, 1) and next(results) == (0, 1)
    with pytest.raises(ZeroDivisionError):
        next(results)
    seen = []
    with pytest.raises(concurrent.futures.TimeoutError):
        for value in pool.map(helpers.sleep_then, [0, 0, 2.0], timeout=1.0):
            seen.append(value)
    assert seen == [None, None]
    assert pool.submit(helpers.square, 4).result(timeout=30) == 16


def test_a_result_that_does_not_pickle_fails_its_item_alone_and_its_chunk_keeps_the_others(pool):
    # One chunk of six items; the worker sends tensors (in shared memory, by fd) and, for
    # item 3, a lock that does not pickle: ProcessPoolExecutor's error for that item alone.
    results = pool.map(pool_cases.tensor_or_lock, [0, 1, 2, 4, 5, 3], chunksize=6)
    assert [next(results).tolist() for _ in range(5)] == [[float(i)] * 4 for i in (0, 1, 2, 4, 5)]
    with pytest.raises(TypeError, match=r"^cannot pickle '_thread.lock' object$") as info:
        next(results)
    assert type(info.value.__cause__) is _RemoteTraceback
    results = pool.map(pool_cases.tensor_or_lock, range(6), chunksize=6)
    assert [next(results).tolist() for _ in range(3)] == [[float(i)] * 4 for i in range(3)]
    with pytest.raises(TypeError, match="cannot pickle '_thread.lock' object"):
        next(results)


def test_map_keeps_no_reference_to_what_it_yielded(pool):
    for obj in pool.map(helpers.make_opaque, range(10)):
        ref = weakref.ref(obj)
        del obj
        assert ref() is None


def test_map_runs_without_being_iterated(tmp_path):
    paths = [str(tmp_path / f"f{i}") for i in range(6)]
    pool = tether.Pool(2)
    pool.map(helpers.write_after, paths, [0.05] * 6)
    pool.shutdown(wait=True)
    assert all(os.path.exists(p) for p in paths)


def test_wait_and_as_completed_see_pool_futures(pool):
    quick = pool.submit(helpers.square, 7)
    slow = pool.submit(helpers.sleep_then, 1.0)
    done, not_done = concurrent.futures.wait(
        [quick, slow], return_when=concurrent.futures.FIRST_COMPLETED
    )
    assert done == {quick} and not_done == {slow}
    failing = pool.submit(divmod, 1, 0)
    done, _ = concurrent.futures.wait(
        [failing, slow], return_when=concurrent.futures.FIRST_EXCEPTION
    )
    assert failing in done
    assert set(concurrent.futures.as_completed([quick, slow, failing], timeout=30)) == {
        quick,
        slow,
        failing,
    }


def test_all_workers_start_with_the_pool_and_are_ready_when_it_returns():
    with tether.Pool(3) as pool:
        pids = pool.pids()
        assert len(pids) == 3 == pool.processes
        # Ready: one task each, all at once, on three different workers.
        futures = [pool.submit(helpers.sleep_then, 0.5, i) for i in range(3)]
        assert [f.result(timeout=30) for f in futures] == [0, 1, 2]
        assert set(pool.map(helpers.pid_of, range(3))) <= set(pids)


def test_workers_are_direct_children_and_reused(pool):
    pids = set(pool.pids())
    assert set(pool.map(helpers.parent_pid, range(20))) == {os.getpid()}
    assert set(pool.map(helpers.pid_of, range(200))) <= pids


# -- cancellation ---------------------------------------------------------------------------


def _healed(pool, limit=30):
    """Waits until the pool has all its workers again (a replacement starts in the
    background); returns their pids."""
    deadline = time.monotonic() + limit
    while len(pool.pids()) < pool.processes:
        assert time.monotonic() < deadline, "the pool did not heal"
        time.sleep(0.01)
    return pool.pids()


def _wait_running(future, limit=30):
    deadline = time.monotonic() + limit
    while not future.running():
        assert time.monotonic() < deadline, "the task never started"
        time.sleep(0.01)


def test_a_task_not_started_is_cancelled_wherever_it_waits(tmp_path):
    with tether.Pool(1) as pool:
        running = pool.submit(helpers.sleep_then, 0.5, "first")
        _wait_running(running)
        in_socket = pool.submit(helpers.write_after, str(tmp_path / "a"), 0)
        queued = pool.submit(helpers.write_after, str(tmp_path / "b"), 0)
        assert not running.cancel() and running.running()
        assert in_socket.cancel() and queued.cancel()
        done, _ = concurrent.futures.wait([in_socket, queued], timeout=0)
        assert done == {in_socket, queued}
        assert running.result(timeout=30) == "first"
        assert pool.submit(helpers.square, 2).result(timeout=30) == 4
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")


def test_shutdown_cancel_futures_cancels_every_task_not_started(tmp_path):
    pool = tether.Pool(1)
    running = pool.submit(helpers.sleep_then, 0.5, 1)
    _wait_running(running)
    # One waits in the worker's socket, the rest in the queue.
    rest = [pool.submit(helpers.write_after, str(tmp_path / f"f{i}"), 0) for i in range(5)]
    pool.shutdown(wait=True, cancel_futures=True)
    assert running.result() == 1
    assert all(f.cancelled() for f in rest)
    assert os.listdir(tmp_path) == []


def test_submit_during_and_after_shutdown():
    pool = tether.Pool(1)
    slow = pool.submit(helpers.sleep_then, 0.5, "done")
    errors = []

    def submit_later():
        time.sleep(0.2)
        try:
            pool.submit(helpers.square, 1)
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=submit_later)
    thread.start()
    pool.shutdown(wait=True)
    thread.join()
    assert slow.result() == "done"
    assert errors and "cannot schedule new futures after shutdown" in str(errors[0])
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(helpers.square, 1)


def test_shutdown_without_wait_returns_at_once_and_the_work_completes():
    pool = tether.Pool(1)
    tasks = [pool.submit(helpers.sleep_then, 0.3, i) for i in range(3)]
    pids = pool.pids()
    started = time.monotonic()
    pool.shutdown(wait=False)
    assert time.monotonic() - started < 0.25
    assert [t.result(timeout=30) for t in tasks] == [0, 1, 2]
    assert wait_gone(pids, 10) == []


def test_a_garbage_collected_pool_finishes_its_work_then_stops():
    pool = tether.Pool(1)
    pids = pool.pids()
    results = pool.map(abs, range(-5, 5))
    del pool
    gc.collect()
    assert list(results) == [5, 4, 3, 2, 1, 0, 1, 2, 3, 4]
    assert wait_gone(pids, 10) == []


@pytest.mark.parametrize("how", ["no shutdown", "shutdown(wait=False)", "garbage"])
def test_pending_work_finishes_before_the_interpreter_exits(tmp_path, how):
    ending = {
        "no shutdown": "",
        "shutdown(wait=False)": "pool.shutdown(wait=False)",
        "garbage": "del pool",
    }
    result = _run_script(f"""
        import tether, pool_helpers
        if __name__ == "__main__":
            pool = tether.Pool(2)
            print(*pool.pids(), flush=True)
            for name in ("a", "b", "c"):
                pool.submit(pool_helpers.write_after, {str(tmp_path)!r} + "/" + name, 1.0)
            {ending[how]}
    """)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "c"]
    assert wait_gone([int(p) for p in result.stdout.split()], 5) == []


def test_cancelled_work_does_not_hold_up_the_interpreters_exit(tmp_path):
    result = _run_script(f"""
        import tether, pool_helpers
        if __name__ == "__main__":
            pool = tether.Pool(1)
            pool.submit(pool_helpers.write_after, {str(tmp_path)!r} + "/first", 0.5)
            for i in range(5):
                pool.submit(pool_helpers.write_after, {str(tmp_path)!r} + f"/{{i}}", 0.5)
            pool.shutdown(wait=False, cancel_futures=True)
    """)
    assert result.returncode == 0, result.stderr
    assert os.listdir(tmp_path) in ([], ["first"])


# -- done-callbacks -------------------------------------------------------------------------


class _Halt(BaseException):
    pass


@pytest.mark.parametrize("error", [ValueError("callback"), SystemExit(3), _Halt()])
def test_a_raising_callback_is_logged_and_delivery_goes_on(caplog, error):
    seen = []

    def raising(future):
        raise error

    with tether.Pool(1) as pool:
        future = pool.submit(helpers.sleep_then, 0.3, "x")
        with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
            future.add_done_callback(raising)
            future.add_done_callback(lambda f: seen.append(f.result()))
            assert future.result(timeout=30) == "x"
            assert pool.submit(helpers.square, 3).result(timeout=30) == 9
            deadline = time.monotonic() + 10
            while not seen and time.monotonic() < deadline:
                time.sleep(0.01)
    assert seen == ["x"]
    records = [r for r in caplog.records if r.name == "concurrent.futures"]
    assert records and records[0].getMessage().startswith("exception calling callback for")
    assert records[0].exc_info[0] is type(error)


# -- crashes (loky's matrix) ----------------------------------------------------------------


@pytest.mark.parametrize(
    "fn, args, pattern",
    [
        (helpers.identity, (helpers.SegfaultAtUnpickle(),), r"killed by signal SIGSEGV"),
        (helpers.identity, (helpers.CExitAtUnpickle(),), r"exited with code 0"),
        (helpers.segfault, (), r"killed by signal SIGSEGV"),
        (helpers.c_exit, (3,), r"exited with code 3"),
        (helpers.kill_self, (), r"killed by signal SIGKILL"),
        (helpers.make, ("CExitAtPickle",), r"exited with code 0"),
        (helpers.make, ("SegfaultAtPickle",), r"killed by signal SIGSEGV"),
    ],
    ids=[
        "segv-unpickle",
        "c-exit-unpickle",
        "segv-run",
        "c-exit-run",
        "sigkill-run",
        "c-exit-pickle-result",
        "segv-pickle-result",
    ],
)
def test_worker_crashes_fail_that_task_and_heal(fresh, fn, args, pattern):
    before = fresh.pids()
    future = fresh.submit(fn, *args)
    with pytest.raises(tether.WorkerCrashedError, match=pattern) as info:
        future.result(timeout=30)
    assert isinstance(info.value, BrokenProcessPool)
    assert info.value.pid in before
    assert f"pid {info.value.pid}" in str(info.value)
    assert fresh.submit(helpers.square, 6).result(timeout=30) == 36
    assert info.value.pid not in _healed(fresh)


def test_a_result_computed_before_the_worker_dies_freeing_the_task_is_delivered(fresh):
    # The task's argument kills the worker when it is freed, after the task returned.
    before = fresh.pids()
    assert fresh.submit(helpers.pid_of, helpers.CExitAtGC()).result(timeout=30) in before
    results = fresh.map(helpers.pid_of, [helpers.CExitAtGC()], timeout=30)
    assert next(results) in set(before) | set(_healed(fresh))
    assert fresh.submit(helpers.square, 6).result(timeout=30) == 36
    assert len(set(_healed(fresh)) - set(before)) >= 1


def _times_out_at_once(future):
    for wait in (future.result, future.exception):
        start = time.monotonic()
        with pytest.raises(concurrent.futures.TimeoutError):
            wait(timeout=0.3)
        assert time.monotonic() - start < 1.5


def test_result_and_exception_timeouts_raise_while_the_task_runs(fresh):
    running = fresh.submit(helpers.sleep_then, 3.0, "running")
    _wait_running(running)
    _times_out_at_once(running)
    assert running.result(timeout=30) == "running"


def test_result_and_exception_timeouts_raise_while_the_task_is_queued(fresh):
    busy = [fresh.submit(helpers.sleep_then, 3.0) for _ in range(fresh.processes)]
    queued = fresh.submit(helpers.sleep_then, 0.0, "queued")
    _times_out_at_once(queued)
    assert queued.result(timeout=30) == "queued"
    assert [f.result(timeout=30) for f in busy] == [None] * len(busy)


def test_a_crash_in_map_fails_that_item(fresh):
    results = fresh.map(helpers.maybe_crash, range(12), [6] * 12)
    assert [next(results) for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(tether.WorkerCrashedError, match="while running this task"):
        next(results)


def test_a_crash_in_a_chunk_fails_the_items_it_ran_and_that_item(fresh):
    # Six items travel together: the worker runs 0..4, dies in 5, never sends 0..4.
    results = fresh.map(helpers.maybe_crash, range(12), [6] * 12, chunksize=6)
    with pytest.raises(tether.WorkerCrashedError, match="after running this task"):
        next(results)
    assert list(fresh.map(helpers.square, range(8), chunksize=4)) == [i * i for i in range(8)]


def test_ctrl_c_interrupts_a_wait_for_a_result():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
            import tether, pool_helpers
            if __name__ == "__main__":
                pool = tether.Pool(1)
                future = pool.submit(pool_helpers.sleep_then, 1.0)
                print("waiting", flush=True)
                try:
                    future.result()
                except KeyboardInterrupt:
                    print("interrupted", flush=True)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=HERE),
        preexec_fn=sigint_as_at_a_terminal,
    )
    try:
        assert proc.stdout.readline().strip() == "waiting"
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        assert proc.stdout.readline().strip() == "interrupted"
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


@pytest.mark.parametrize("workers", [1, 2, 5, 13])
def test_crash_races(workers):
    with tether.Pool(workers) as pool:
        futures = [pool.submit(helpers.maybe_crash, i, 10) for i in range(60)]
        for i, future in enumerate(futures):
            if i % 10 == 9:
                with pytest.raises(tether.WorkerCrashedError):
                    future.result(timeout=60)
            else:
                assert future.result(timeout=60) == i  # tasks never started are rerun
        assert list(pool.map(helpers.square, range(30))) == [i * i for i in range(30)]


def test_terminate_the_worker_running_a_task():
    with tether.Pool(1) as pool:
        (victim,) = pool.pids()
        future = pool.submit(helpers.sleep_then, 30)
        _wait_running(future)
        os.kill(victim, signal.SIGTERM)
        with pytest.raises(tether.WorkerCrashedError) as info:
            future.result(timeout=30)
        assert info.value.pid == victim and info.value.signal_name == "SIGTERM"
        assert pool.submit(helpers.square, 2).result(timeout=30) == 4


def test_starting_a_replacement_never_holds_up_the_other_workers(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with tether.Pool(2, initializer=helpers.wait_for_fifo, initargs=(str(tmp_path),)) as pool:
        victim, survivor = pool.pids()
        (tmp_path / "hold").touch()  # from now on, a new worker waits for the FIFO
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while victim in pool.pids():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # The replacement is blocked in its initializer: the survivor serves everything.
        assert set(pool.map(helpers.pid_of, range(50))) == {survivor}
        assert pool.submit(helpers.pid_of).result(timeout=30) == survivor
        with open(tmp_path / "fifo", "w") as fifo:
            fifo.write("go\n")
        assert victim not in _healed(pool)


def test_workers_retire_after_max_tasks_per_child():
    with pytest.raises(ValueError, match="max_tasks_per_child"):
        tether.Pool(1, max_tasks_per_child=0)
    with pytest.raises(ValueError, match="incompatible with the 'fork' start method"):
        tether.Pool(1, start_method="fork", max_tasks_per_child=2)
    with tether.Pool(1, max_tasks_per_child=2) as pool:
        pids = [pool.submit(helpers.pid_of).result(timeout=30) for _ in range(5)]
        assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]
        # Tasks queued for a worker that retires run on the next one.
        futures = [pool.submit(helpers.square, i) for i in range(7)]
        assert [f.result(timeout=30) for f in futures] == [i * i for i in range(7)]
        assert list(pool.map(helpers.square, range(5))) == [0, 1, 4, 9, 16]


def test_a_failing_initializer_makes_the_pool_raise_its_error_at_once():
    with pytest.raises(tether.BrokenPool, match="no init"):
        tether.Pool(1, initializer=helpers.raise_value_error, initargs=("no init",))


# -- what tether exports --------------------------------------------------------------------


def test_every_pool_exception_is_exported_without_importing_the_pool():
    result = _run_script("""
        import sys, tether
        assert "torch" not in sys.modules and "tether.pool" not in sys.modules
        from concurrent.futures.process import BrokenProcessPool
        from tether import BrokenPool, NoFreeWorkerError, RemoteError, WorkerCrashedError
        import tether.pool as pool
        assert WorkerCrashedError is pool.WorkerCrashedError and BrokenPool is pool.BrokenPool
        assert NoFreeWorkerError is pool.NoFreeWorkerError and RemoteError is pool.RemoteError
        assert issubclass(WorkerCrashedError, BrokenProcessPool)
        assert issubclass(BrokenPool, BrokenProcessPool)
        assert issubclass(NoFreeWorkerError, RuntimeError)
        print("ok")
    """)
    assert result.stdout.strip() == "ok", result.stderr
    error = tether.WorkerCrashedError("m", 12, -9, "SIGKILL")
    again = pickle.loads(pickle.dumps(error))
    assert (again.pid, again.exitcode, again.signal_name) == (12, -9, "SIGKILL")
