"""What runs in a pool worker between two loaders and writes to its copy of a dataset (a
thread the first loader left running, a signal handler, a finalizer the garbage collector
runs, an executor task that reaches the copy through a module global) never reaches the
next loader: it sees the dataset as the parent has it, as torch's new fork workers do. A
worker trusts a copy proven after its last loader only while nothing of that kind can
have run since."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, List

import pool_datasets as pdata
import pytest
from torch.utils.data import DataLoader

import tether

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def pool():
    with tether.Pool(2) as pool:
        yield pool


def items(dataset: Any, context: Any, **kwargs: Any) -> List[Any]:
    loader = DataLoader(
        dataset, batch_size=None, num_workers=2, multiprocessing_context=context, **kwargs
    )
    return sorted((int(i), int(mark)) for i, mark in loader)


def unmarked(n: int) -> List[Any]:
    return [(i, 0) for i in range(n)]


def wait_for(done: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "what was to mark the copies never did"
        time.sleep(0.01)


def test_a_thread_the_last_loader_left_running(pool, tmp_path):
    go = str(tmp_path / "go")
    dataset = pdata.Marked(go=go)
    assert items(dataset, "fork") == unmarked(6)
    workers = []
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=2,
        multiprocessing_context=pool.context(),
        worker_init_fn=pdata.mark_from_a_thread,
    )
    it = iter(loader)
    workers = [w.pid for w in it._workers]
    assert sorted((int(i), int(m)) for i, m in it) == unmarked(6)
    del it
    open(go, "w").close()
    wait_for(lambda: all(os.path.exists(f"{go}.{pid}") for pid in workers))
    assert items(dataset, pool.context()) == unmarked(6)


def test_a_signal_handler_the_last_loader_installed(pool):
    dataset = pdata.Marked()
    it = iter(
        DataLoader(
            dataset,
            batch_size=None,
            num_workers=2,
            multiprocessing_context=pool.context(),
            worker_init_fn=pdata.mark_on_sigusr1,
        )
    )
    workers = [w.pid for w in it._workers]
    assert sorted((int(i), int(m)) for i, m in it) == unmarked(6)
    del it
    time.sleep(0.05)  # both workers are back to waiting for their next message
    for pid in workers:
        os.kill(pid, signal.SIGUSR1)
    time.sleep(0.1)
    assert items(dataset, pool.context()) == unmarked(6)


@pytest.mark.parametrize("kind", [pdata.MarkedByAFinalizer, pdata.MarkedByAResurrectingFinalizer])
def test_a_finalizer_the_garbage_collector_runs_between_loaders(pool, kind):
    dataset = kind()
    assert items(dataset, "fork") == unmarked(6)
    assert items(dataset, pool.context()) == unmarked(6)
    time.sleep(1.0)  # the idle workers collect their garbage: the finalizer marks a copy
    assert items(dataset, pool.context()) == unmarked(6)


def test_a_finalizer_of_the_last_loaders_garbage_in_the_next_loader(pool):
    dataset = pdata.MarkedByAFinalizerCollectedLater()
    assert items(dataset, "fork") == unmarked(6)
    for _ in range(3):  # one right after the other: the workers are never idle
        assert items(dataset, pool.context()) == unmarked(6)


@pytest.mark.parametrize(
    "kind, task",
    [
        # The task marks the copy.
        (pdata.Registered, pdata.mark_registered),
        # The task leaves garbage whose finalizer marks the copy when the next loader's
        # first item collects it.
        (pdata.RegisteredCollecting, pdata.leave_a_marker),
    ],
)
def test_an_executor_task_that_reaches_the_copy(pool, kind, task):
    dataset = kind()
    assert items(dataset, pool.context()) == unmarked(6)
    ran_on = set()
    deadline = time.monotonic() + 20
    while len(ran_on) < 2 and time.monotonic() < deadline:
        ran_on.update(pool.map(task, range(4)))
    assert ran_on  # at least one worker's copy is marked
    assert items(dataset, pool.context()) == unmarked(6)


@pytest.mark.parametrize(
    "unseen",
    ["nothing", "a thread", "a trace function", "a profile function", "a monitoring tool",
     "a handler of Python code", "a built-in method of an object as handler"],
)  # fmt: skip
def test_what_a_worker_counts_as_code_that_could_run_unseen(monkeypatch, unseen):
    import threading
    from types import SimpleNamespace

    from tether.pool import trust

    # A quiet worker: one thread, no hooks, only built-in handlers of modules.
    handler: Any = signal.default_int_handler
    monitoring = SimpleNamespace(get_tool=lambda tool: None)
    monkeypatch.setattr(threading, "active_count", lambda: 2 if unseen == "a thread" else 1)
    hook = {"a trace function": "gettrace", "a profile function": "getprofile"}.get(unseen)
    for name in ("gettrace", "getprofile"):
        monkeypatch.setattr(sys, name, lambda name=name: print if name == hook else None)
    if unseen == "a monitoring tool":  # Python 3.12's sys.monitoring
        monitoring = SimpleNamespace(get_tool=lambda tool: "coverage" if tool == 1 else None)
    monkeypatch.setattr(sys, "monitoring", monitoring, raising=False)
    if unseen == "a handler of Python code":
        handler = lambda *args: None  # noqa: E731
    elif unseen == "a built-in method of an object as handler":
        handler = [].append
    monkeypatch.setattr(signal, "getsignal", lambda signum: handler)
    assert trust._nothing_else_runs() is (unseen == "nothing")
