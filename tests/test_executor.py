"""``tether.Pool`` as a ``concurrent.futures.Executor``: results, exceptions, map, and loky's
crash matrix (each case gives a clear error, never a hang, and the pool heals)."""

from __future__ import annotations

import concurrent.futures
import pickle
import signal
import sys
import threading
import time

import pool_helpers as helpers
import pytest

import tether
from tether._worker import ResultPicklingError, TaskUnpicklingError
from tether.pool import WorkerCrashedError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pool():
    with tether.Pool(2) as pool:
        yield pool


@pytest.fixture
def fresh():
    """A pool of its own, for tests that kill workers (a replaced worker is a new child)."""
    with tether.Pool(2) as pool:
        yield pool


def test_submit_result_and_exception(pool):
    assert pool.submit(helpers.add, 2, b=3).result(timeout=30) == 5
    future = pool.submit(helpers.raise_value_error, "boom")
    with pytest.raises(ValueError, match="boom") as info:
        future.result(timeout=30)
    assert "raise_value_error" in str(info.value.__cause__)  # the worker's traceback
    assert isinstance(future, concurrent.futures.Future)
    assert isinstance(pool, concurrent.futures.Executor)


def test_map_in_order_with_chunks(pool):
    assert list(pool.map(helpers.square, range(1000))) == [i * i for i in range(1000)]
    assert list(pool.map(helpers.add, range(50), range(50), chunksize=7)) == [
        2 * i for i in range(50)
    ]
    with pytest.raises(ValueError):
        list(pool.map(helpers.square, range(3), chunksize=0))


def test_map_raises_at_the_failing_item_and_times_out(pool):
    results = pool.map(helpers.raise_value_error, ["a", "b"])
    with pytest.raises(ValueError, match="a"):
        next(results)
    with pytest.raises(concurrent.futures.TimeoutError):
        list(pool.map(helpers.sleep_then, [2.0], timeout=0.2))
    assert pool.submit(helpers.square, 4).result(timeout=30) == 16


def test_workers_are_direct_children_and_reused(pool):
    import os

    pids = set(pool.pids())
    assert set(pool.map(helpers.parent_pid, range(20))) == {os.getpid()}
    assert set(pool.map(helpers.pid_of, range(200))) <= pids


def test_task_pickling_errors_in_the_parent(pool):
    for bad in (helpers.ErrorAtPickle(), helpers.ExitAtPickle()):
        future = pool.submit(helpers.identity, bad)
        with pytest.raises(pickle.PicklingError, match="Could not pickle the task"):
            future.result(timeout=30)
    assert pool.submit(helpers.square, 3).result(timeout=30) == 9


@pytest.mark.parametrize("bad", [helpers.ExitAtUnpickle, helpers.ErrorAtUnpickle])
def test_task_unpickling_errors_in_the_worker(pool, bad):
    pids = pool.pids()
    with pytest.raises(TaskUnpicklingError, match="could not unpickle the task"):
        pool.submit(helpers.identity, bad()).result(timeout=30)
    assert pool.pids() == pids  # the worker survived


@pytest.mark.parametrize("kind", ["ErrorAtPickle", "ExitAtPickle"])
def test_result_pickling_errors_in_the_worker(pool, kind):
    with pytest.raises(ResultPicklingError, match="could not pickle the result"):
        pool.submit(helpers.make, kind).result(timeout=30)


@pytest.mark.parametrize("kind", ["ErrorAtUnpickle", "ExitAtUnpickle"])
def test_result_unpickling_errors_in_the_parent(pool, kind):
    with pytest.raises(RuntimeError, match="could not unpickle the result"):
        pool.submit(helpers.make, kind).result(timeout=30)
    assert pool.submit(helpers.square, 5).result(timeout=30) == 25


def test_task_sys_exit_is_its_result(pool):
    with pytest.raises(SystemExit):
        pool.submit(sys.exit, 3).result(timeout=30)


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
        (helpers.pid_of, (helpers.CExitAtGC(),), r"exited with code 4"),
    ],
    ids=[
        "segv-unpickle",
        "c-exit-unpickle",
        "segv-run",
        "c-exit-run",
        "sigkill-run",
        "c-exit-pickle-result",
        "segv-pickle-result",
        "c-exit-gc",
    ],
)
def test_worker_crashes_fail_that_task_and_heal(fresh, fn, args, pattern):
    before = fresh.pids()
    future = fresh.submit(fn, *args)
    with pytest.raises(WorkerCrashedError, match=pattern) as info:
        future.result(timeout=30)
    assert info.value.pid in before
    assert f"pid {info.value.pid}" in str(info.value)
    assert fresh.submit(helpers.square, 6).result(timeout=30) == 36
    assert info.value.pid not in fresh.pids() and len(fresh.pids()) == 2


@pytest.mark.parametrize("workers", [1, 2, 5, 13])
def test_crash_races(workers):
    with tether.Pool(workers) as pool:
        futures = [pool.submit(helpers.maybe_crash, i, 10) for i in range(60)]
        for i, future in enumerate(futures):
            if i % 10 == 9:
                with pytest.raises(WorkerCrashedError):
                    future.result(timeout=60)
            else:
                assert future.result(timeout=60) == i  # tasks never started are rerun
        assert list(pool.map(helpers.square, range(30))) == [i * i for i in range(30)]


def test_terminate_one_worker(fresh):
    future = fresh.submit(helpers.sleep_then, 30)
    time.sleep(0.3)
    (victim,) = [p for p in fresh.pids() if p in _running_pids(fresh)] or fresh.pids()[:1]
    import os

    os.kill(victim, signal.SIGTERM)
    try:
        future.result(timeout=30)
    except WorkerCrashedError as exc:
        assert exc.pid == victim and exc.signal_name == "SIGTERM"
    assert fresh.submit(helpers.square, 2).result(timeout=30) == 4


def _running_pids(pool):
    core = pool._core
    with core.lock:
        return [w.pid for w in core.workers if w is not None and w.inflight]


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
    assert errors and "after shutdown" in str(errors[0])
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(helpers.square, 1)


def test_shutdown_cancel_futures_and_no_wait():
    pool = tether.Pool(1)
    running = pool.submit(helpers.sleep_then, 0.3, 1)
    queued = [pool.submit(helpers.square, i) for i in range(20)]
    pool.shutdown(wait=True, cancel_futures=True)
    assert running.result() == 1
    assert all(f.cancelled() or f.done() for f in queued)
    assert any(f.cancelled() for f in queued)

    pool = tether.Pool(1)
    last = pool.submit(helpers.sleep_then, 0.2, 7)
    pids = pool.pids()
    pool.shutdown(wait=False)
    assert last.result(timeout=30) == 7
    from conftest import wait_gone

    assert wait_gone(pids, 10) == []
    pool._core.hub.join(10)
    assert not pool._core.hub.is_alive()
