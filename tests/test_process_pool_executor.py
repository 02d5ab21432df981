"""``tether.ProcessPoolExecutor``: code written for ``concurrent.futures.ProcessPoolExecutor``
runs unchanged. The signature, the errors for bad arguments and misuse, and the private
attributes code reads are compared with CPython's executor side by side where that starts
no process; the rest is what CPython's own process-pool tests check, as tether does it.

Where it differs on purpose (a dead worker fails only its task and the pool heals; the
default start method is tether's zygote), the tests say so."""

from __future__ import annotations

import concurrent.futures
import inspect
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures.process import BrokenProcessPool, _RemoteTraceback
from typing import Any, Callable, Dict

import pool_helpers as helpers
import pytest
import share_helpers

import tether
from conftest import cmdline

pytestmark = pytest.mark.timeout(120)

HERE = os.path.dirname(os.path.abspath(__file__))
CPython = concurrent.futures.ProcessPoolExecutor


@pytest.fixture(scope="module")
def executor():
    """One executor for the tests that kill no worker, its two workers started (they start
    as tasks come, and the per-test check must not count them as a test's leftovers)."""
    with tether.ProcessPoolExecutor(2) as executor:
        for future in [executor.submit(helpers.sleep_then, 0.2) for _ in range(2)]:
            future.result(timeout=60)
        yield executor


def _raised(make: Callable[[], Any]) -> BaseException:
    with pytest.raises(Exception) as info:
        make()
    return info.value


def _same_error(call: Callable[[Any], Any]) -> None:
    """``call(cls)`` fails alike with CPython's executor and tether's: type and words."""
    theirs, ours = _raised(lambda: call(CPython)), _raised(lambda: call(tether.ProcessPoolExecutor))
    assert (type(ours), str(ours)) == (type(theirs), str(theirs))


# -- what it takes and what it says --------------------------------------------------------------


def test_the_signature_is_process_pool_executors():
    theirs = inspect.signature(CPython.__init__)
    ours = inspect.signature(tether.ProcessPoolExecutor.__init__)
    assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == [
        (p.name, p.kind, p.default) for p in theirs.parameters.values()
    ]
    for method in ("submit", "map", "shutdown"):
        theirs = inspect.signature(getattr(CPython, method))
        ours = inspect.signature(getattr(tether.ProcessPoolExecutor, method))
        assert list(ours.parameters) == list(theirs.parameters), method
    assert issubclass(tether.ProcessPoolExecutor, concurrent.futures.Executor)
    assert "ProcessPoolExecutor" in tether.__all__


BAD_ARGUMENTS: Dict[str, Callable[[Any], Any]] = {
    "max_workers=0": lambda cls: cls(max_workers=0),
    "max_workers=-1": lambda cls: cls(-1),
    "max_workers='2'": lambda cls: cls("2"),
    "max_workers=0 and a bad context": lambda cls: cls(0, mp_context=object()),
    "initializer not callable": lambda cls: cls(1, initializer=5),
    "max_tasks_per_child='3'": lambda cls: cls(1, max_tasks_per_child="3"),
    "max_tasks_per_child=0": lambda cls: cls(1, max_tasks_per_child=0),
    "max_tasks_per_child with fork": lambda cls: cls(
        1, mp_context=multiprocessing.get_context("fork"), max_tasks_per_child=3
    ),
}


@pytest.mark.parametrize("call", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS)
def test_bad_arguments_fail_with_cpythons_exception_and_words(call):
    _same_error(call)


def test_misuse_after_shutdown_fails_with_cpythons_exception_and_words():
    def after_shutdown(cls: Any) -> None:
        executor = cls(1)
        executor.shutdown()
        executor.submit(pow, 2, 3)

    _same_error(after_shutdown)

    def bad_chunksize(cls: Any) -> None:
        with cls(1) as executor:
            executor.map(pow, [1], [2], chunksize=0)

    _same_error(bad_chunksize)


def test_mp_context_picks_the_start_method_of_tethers_workers():
    """A context or its name gives tether's start method of that name; None gives the
    zygote ("forkserver"), or "spawn" with max_tasks_per_child as CPython documents."""
    cases = [
        (None, {}, "forkserver"),
        (None, {"max_tasks_per_child": 2}, "spawn"),
        ("spawn", {}, "spawn"),
        (multiprocessing.get_context("fork"), {}, "fork"),
        (multiprocessing.get_context("forkserver"), {}, "forkserver"),
    ]
    for mp_context, kwargs, method in cases:
        with tether.ProcessPoolExecutor(1, mp_context, **kwargs) as executor:
            assert executor._mp_context.get_start_method() == method
            if mp_context is not None and not isinstance(mp_context, str):
                assert executor._mp_context is mp_context
            pid = executor.submit(helpers.pid_of).result(timeout=60)
            assert f"[{method}, parent {os.getpid()}]" in cmdline(pid)
    error = _raised(lambda: tether.ProcessPoolExecutor(1, "threads"))
    assert isinstance(error, ValueError)
    assert str(error).startswith("cannot find context for 'threads': ")
    assert "'forkserver'" in str(error) and "'spawn'" in str(error)
    error = _raised(lambda: tether.ProcessPoolExecutor(1, 3))
    assert isinstance(error, TypeError) and "mp_context" in str(error)


def test_max_workers_defaults_to_the_cpu_count():
    with tether.ProcessPoolExecutor() as executor:
        assert executor._max_workers == os.cpu_count()
        assert repr(executor) == (
            f"<tether.ProcessPoolExecutor max_workers={os.cpu_count()} "
            "start_method='forkserver' state=running>"
        )
    assert repr(executor).endswith("state=closed>")


# -- results, as concurrent.futures gives them -----------------------------------------------------


def test_submit_map_and_the_workers_traceback(executor):
    assert executor.submit(helpers.add, 2, b=8).result(timeout=30) == 10
    assert executor.submit(helpers.capture, 1, self=2, fn=3).result(timeout=30) == (
        (1,),
        {"self": 2, "fn": 3},
    )
    with pytest.raises(TypeError):
        executor.submit(fn=helpers.capture)  # type: ignore[call-arg]
    assert list(executor.map(pow, range(10), range(10), chunksize=3)) == [i**i for i in range(10)]
    results = executor.map(divmod, [1, 1, 1], [2, 0, 5])
    assert next(results) == (0, 1)
    with pytest.raises(ZeroDivisionError):
        next(results)
    with pytest.raises(RuntimeError) as info:
        executor.submit(helpers.raise_runtime_error).result(timeout=30)
    assert type(info.value.__cause__) is _RemoteTraceback
    assert "raise RuntimeError(123)" in info.value.__cause__.tb


def test_a_task_that_cannot_be_unpickled_in_its_worker_fails_with_broken_process_pool(executor):
    """As CPython's pool says it (its worker dies of it); here only that task fails, with
    the error as the cause, and the pool goes on. tether.Pool gives the error itself."""
    cases = ((helpers.ErrorAtUnpickle(), ValueError), (helpers.ExitAtUnpickle(), SystemExit))
    for bad, cause in cases:
        future = executor.submit(helpers.identity, bad)
        with pytest.raises(BrokenProcessPool, match="could not be unpickled in its worker") as info:
            future.result(timeout=30)
        assert type(info.value.__cause__) is cause
        assert "never ran" in str(info.value)
        assert executor.submit(helpers.square, 3).result(timeout=30) == 9
    with tether.Pool(1) as pool:
        with pytest.raises(ValueError, match="error while unpickling"):
            pool.submit(helpers.identity, helpers.ErrorAtUnpickle()).result(timeout=30)


def test_a_result_that_cannot_be_unpickled_here_fails_with_broken_process_pool(executor):
    for kind, cause in (("ErrorAtUnpickle", ValueError), ("ExitAtUnpickle", SystemExit)):
        with pytest.raises(BrokenProcessPool, match="result could not be unpickled here") as info:
            executor.submit(helpers.make, kind).result(timeout=30)
        assert type(info.value.__cause__) is cause
        with pytest.raises(BrokenProcessPool) as info:
            list(executor.map(helpers.make, [kind, kind]))
        assert type(info.value.__cause__) is cause
    assert executor.submit(helpers.square, 4).result(timeout=30) == 16


def test_errors_pickling_a_task_or_a_result_are_the_original_ones(executor):
    with pytest.raises(ValueError, match="error while pickling"):
        executor.submit(helpers.identity, helpers.ErrorAtPickle()).result(timeout=30)
    with pytest.raises(ValueError, match="error while pickling"):
        executor.submit(helpers.make, "ErrorAtPickle").result(timeout=30)
    with pytest.raises(SystemExit):
        executor.submit(helpers.make, "ExitAtPickle").result(timeout=30)


# -- workers: on demand, and as code reads them ----------------------------------------------------


def test_workers_start_on_demand_and_an_idle_one_is_reused():
    with tether.ProcessPoolExecutor(4, "forkserver") as executor:
        assert executor._processes == {}
        for x in range(3):
            assert executor.submit(helpers.square, x).result(timeout=60) == x * x
        assert len(executor._processes) == 1
        busy = [executor.submit(helpers.sleep_then, 0.5) for _ in range(3)]
        assert 2 <= len(executor._processes) <= 3  # one more each while none was idle
        more = [executor.submit(helpers.sleep_then, 0.5) for _ in range(4)]
        assert len(executor._processes) == 4  # never more than max_workers
        for future in busy + more:
            future.result(timeout=60)


def test_submits_from_many_threads_at_once_start_a_worker_each():
    with tether.ProcessPoolExecutor(4, "forkserver") as executor:
        barrier = threading.Barrier(4)

        def submit() -> concurrent.futures.Future:
            barrier.wait(30)
            return executor.submit(helpers.sleep_then, 0.5)

        with concurrent.futures.ThreadPoolExecutor(4) as threads:
            futures = [f.result() for f in [threads.submit(submit) for _ in range(4)]]
        assert len(executor._processes) == 4
        for future in futures:
            future.result(timeout=60)


def test_fork_starts_every_worker_at_once():
    with tether.ProcessPoolExecutor(3, "fork") as executor:
        assert len(executor._processes) == 3
        assert set(executor.map(helpers.pid_of, range(30))) <= set(executor._processes)


def test_processes_answer_as_multiprocessing_processes_do():
    with tether.ProcessPoolExecutor(2, "forkserver") as executor:
        executor.submit(helpers.square, 2).result(timeout=60)
        ((pid, process),) = executor._processes.items()
        assert process.pid == pid and process.is_alive() and process.exitcode is None
        assert process.daemon and str(pid) in repr(process) and process.name
        assert isinstance(process.sentinel, int)
        process.join(0.05)  # returns while it runs
        future = executor.submit(helpers.sleep_then, 30)
        deadline = time.monotonic() + 30
        while not future.running() and time.monotonic() < deadline:
            time.sleep(0.01)
        process.terminate()
        # CPython's sentence for the event, then the executor's worker, by name and pid.
        said = (
            "^A process in the process pool was terminated abruptly while the future was "
            rf"running or pending: tether\.ProcessPoolExecutor worker \(pid {pid}\) .*SIGTERM"
        )
        with pytest.raises(BrokenProcessPool, match=said):
            future.result(timeout=30)
        process.join(30)
        assert not process.is_alive() and process.exitcode == -signal.SIGTERM
        # The pool heals (CPython's would be broken): another worker takes the next task.
        assert executor.submit(helpers.pid_of).result(timeout=60) != pid
        assert not executor._broken
        replacement = next(p for p in executor._processes.values() if p.pid != pid)
        replacement.kill()
        replacement.join(30)
        assert replacement.exitcode == -signal.SIGKILL
    assert all(not p.is_alive() for p in executor._processes.values())


def test_a_failing_initializer_breaks_the_pool_and_submit_says_why():
    for method in ("forkserver", "fork"):
        executor = tether.ProcessPoolExecutor(
            1, method, initializer=helpers.raise_value_error, initargs=("no init",)
        )
        try:
            first = None
            try:
                first = executor.submit(helpers.square, 2)
            except BrokenProcessPool:
                pass  # "fork" starts its workers at once: broken already
            if first is not None:
                with pytest.raises(BrokenProcessPool, match="no init"):
                    first.result(timeout=60)
            assert "no init" in executor._broken
            assert executor._broken.startswith(
                "A child process terminated abruptly, the process pool is not usable anymore: "
                "a tether.ProcessPoolExecutor worker (pid "
            )
            with pytest.raises(BrokenProcessPool, match="no init"):
                executor.submit(helpers.square, 2)
        finally:
            executor.shutdown()


def test_workers_retire_after_max_tasks_per_child():
    with tether.ProcessPoolExecutor(1, max_tasks_per_child=2) as executor:
        pids = [executor.submit(helpers.pid_of).result(timeout=60) for _ in range(4)]
        assert pids[0] == pids[1] != pids[2] == pids[3]
        assert list(executor._processes) == [pids[3]]


def test_shutdown_is_seen_through_the_manager_thread_and_the_call_queue():
    executor = tether.ProcessPoolExecutor(2)
    results = executor.map(abs, range(-5, 5))
    manager, calls, processes = (
        executor._executor_manager_thread,
        executor._call_queue,
        executor._processes,
    )
    assert manager.is_alive() and not executor._shutdown_thread
    with pytest.raises(AssertionError):
        calls.join_thread()  # as a queue that was not closed
    executor.shutdown(wait=False)
    assert executor._shutdown_thread
    manager.join(30)
    calls.join_thread()
    assert calls.empty() and calls.qsize() == 0
    for process in processes.values():
        process.join(30)
        assert not process.is_alive()
    assert list(results) == [abs(i) for i in range(-5, 5)]


def _run_script(body: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )


def test_at_the_interpreters_exit_work_finishes_and_submit_says_interpreter_shutdown():
    proc = _run_script(
        """
        import atexit
        import pool_helpers
        import tether

        @atexit.register
        def late():
            try:
                executor.submit(pool_helpers.square, 2)
            except RuntimeError as exc:
                print("late:", exc, flush=True)

        if __name__ == "__main__":
            executor = tether.ProcessPoolExecutor(2)
            executor.submit(pool_helpers.sleep_then, 0.5, "apple").add_done_callback(
                lambda f: print(f.result(), flush=True)
            )
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "apple",
        "late: cannot schedule new futures after interpreter shutdown",
    ]


# -- the order tasks start in --------------------------------------------------------------------

#: The executors compared: tether's (its zygote, and fork) and CPython's (fork, forkserver).
_ORDERED = {
    "tether forkserver": lambda: tether.ProcessPoolExecutor(3),
    "tether fork": lambda: tether.ProcessPoolExecutor(3, mp_context="fork"),
    "CPython fork": lambda: CPython(3, mp_context=multiprocessing.get_context("fork")),
    "CPython forkserver": lambda: CPython(3, mp_context=multiprocessing.get_context("forkserver")),
}


@pytest.mark.parametrize("delay", [0.0, 0.2])
@pytest.mark.parametrize("name", list(_ORDERED))
def test_the_tasks_that_run_before_shutdown_cancels_the_rest_are_the_first_submitted(
    tmp_path, name, delay
):
    """Tasks start in submission order: after ``shutdown(cancel_futures=True)``, those that
    ran (and the futures not cancelled) are the first ones submitted, as with CPython's
    executor, whether the workers had started or not."""
    notes = tmp_path / "started"
    executor = _ORDERED[name]()
    try:
        futures = [executor.submit(helpers.note_start, str(notes), i, 0.05) for i in range(36)]
        time.sleep(delay)
        executor.shutdown(wait=True, cancel_futures=True)
    finally:
        if name == "CPython forkserver":
            share_helpers.stop_forkserver()
    ran = sorted(int(line) for line in notes.read_text().split()) if notes.exists() else []
    notes.unlink(missing_ok=True)
    assert ran == list(range(len(ran))), f"{name}: {ran}"
    assert [i for i, f in enumerate(futures) if not f.cancelled()] == ran
    assert [f.result() for f in futures[: len(ran)]] == ran
    assert len(ran) < len(futures), f"{name}: shutdown cancelled nothing"


def _unreaped(pids):
    """Those of ``pids`` that are zombies of this process (reaping them here)."""
    zombies = []
    for pid in pids:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                zombies.append(pid)
        except ChildProcessError:
            pass  # reaped already, as it should be
    return zombies


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_shutdown_with_wait_leaves_every_worker_reaped_as_cpythons_joins_them(method):
    for _ in range(5):
        executor = tether.ProcessPoolExecutor(4, mp_context=multiprocessing.get_context(method))
        assert [f.result() for f in [executor.submit(pow, 2, i) for i in range(8)]][-1] == 128
        pids = list(executor._processes)
        executor.shutdown(wait=True)
        assert pids and _unreaped(pids) == []


def test_a_pool_closed_leaves_every_worker_reaped():
    for _ in range(5):
        with tether.Pool(4) as pool:
            assert list(pool.map(abs, range(-4, 4))) == [4, 3, 2, 1, 0, 1, 2, 3]
            pids = pool.pids()
        assert len(pids) == 4 and _unreaped(pids) == []
