"""``tether.Pool`` itself: construction, the context and its processes, queues and events
(tether channels), start methods, and the pool's lifetime (shutdown, garbage collection,
interpreter exit, a parent killed with SIGKILL)."""

from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.context
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading

import pool_helpers as helpers
import pytest

import tether
from conftest import alive, wait_gone
from tether.pool import channel as pool_channel

pytestmark = pytest.mark.timeout(60)

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def pool():
    with tether.Pool(2) as pool:
        yield pool


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="start method"):
        tether.Pool(1, start_method="threads")
    with pytest.raises(ValueError, match="processes"):
        tether.Pool(0)
    with pytest.raises(TypeError):
        tether.Pool(1, initializer=3)


@pytest.mark.parametrize(
    "how, method, said",
    [
        ("exit 3", "spawn", "exited with code 3"),
        ("SIGKILL", "forkserver", r"was killed by signal SIGKILL \(Killed\)"),
    ],
)
def test_a_pool_whose_worker_dies_while_starting_raises_that_workers_error(
    tmp_path, how, method, said
):
    # Two workers, one of which dies: Pool() never returns with a dead worker.
    expected = rf"a tether.Pool worker \(pid \d+\) {said} before it was ready"
    with pytest.raises(tether.BrokenPool, match=expected):
        tether.Pool(
            2,
            start_method=method,
            initializer=helpers.first_one_ends,
            initargs=(str(tmp_path / "first"), how),
        )


def test_context_is_a_real_multiprocessing_context(pool):
    ctx = pool.context()
    assert isinstance(ctx, multiprocessing.context.BaseContext)
    assert ctx.get_start_method() == "forkserver"
    assert pool.start_method == "forkserver" and pool.processes == 2
    assert "tether" not in repr(multiprocessing.get_context())


def test_process_lifecycle(pool):
    ctx = pool.context()
    q = ctx.Queue()
    p = ctx.Process(target=helpers.sleep_then, args=(0.3,), name="probe")
    p.daemon = True
    assert p.pid is None and not p.is_alive() and p.exitcode is None
    p.start()
    assert p.pid in pool.pids() and p.is_alive() and p.name == "probe"
    p.join(10)
    assert not p.is_alive() and p.exitcode == 0
    failing = ctx.Process(target=helpers.raise_value_error, args=("x",))
    failing.start()
    failing.join(10)
    assert failing.exitcode == 1
    exiting = ctx.Process(target=sys.exit, args=(3,))
    exiting.start()
    exiting.join(10)
    assert exiting.exitcode == 3
    q.close()


def test_queue_and_event_between_processes(pool):
    ctx = pool.context()
    q, back, ev = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_echo, args=(q, back, ev))
    p.start()
    big = b"x" * 300_000  # travels in a memfd
    for item in [1, "two", big, None]:
        q.put(item)
    assert [back.get(timeout=10) for _ in range(3)] == [1, "two", len(big)]
    assert ev.wait(10) and ev.is_set()
    ev.clear()
    assert not ev.is_set() and not ev.wait(0.05)
    p.join(10)
    assert p.exitcode == 0
    with pytest.raises(queue.Empty):
        back.get(timeout=0.05)
    with pytest.raises(queue.Empty):
        back.get_nowait()
    assert back.empty()
    got = []
    reader = threading.Thread(target=lambda: got.append(back.get(timeout=10)))
    reader.start()
    back.put("from a thread")
    reader.join()
    assert got == ["from a thread"]
    for channel in (q, back):
        channel.cancel_join_thread()
        channel.close()


def _echo(q, back, ev):
    while True:
        item = q.get(timeout=10)
        if item is None:
            ev.set()
            return
        back.put(len(item) if isinstance(item, bytes) else item)


def test_queues_travel_only_with_processes_or_messages():
    import pickle

    q = pool_channel.Queue()
    with pytest.raises(RuntimeError, match="travel to other processes only"):
        pickle.dumps(q)
    q.close()


def test_fork_start_method_preload_and_initializer(tmp_path):
    with tether.Pool(
        1, start_method="fork", preload=["json"], initializer=helpers.mark_init, initargs=(41,)
    ) as pool:
        assert pool.context().get_start_method() == "fork"
        assert pool.submit(helpers.parent_pid).result(timeout=30) == os.getpid()
        assert pool.submit(_init_mark).result(timeout=30) == (41, True)


def _init_mark():
    return helpers.INIT_MARK.get("id"), "json" in sys.modules


def test_shutdown_leaves_no_thread_or_process():
    threads = threading.active_count()
    pool = tether.Pool(2)
    pids = pool.pids()
    assert pool.submit(helpers.square, 3).result(timeout=30) == 9
    pool.shutdown()
    assert wait_gone(pids, 5) == []
    assert threading.active_count() == threads
    pool.shutdown()  # twice is fine


def test_garbage_collected_pool_stops_its_workers():
    pool = tether.Pool(1)
    pids = pool.pids()
    pool.submit(helpers.square, 1).result(timeout=30)
    del pool
    gc.collect()
    assert wait_gone(pids, 5) == []


def test_parent_killed_takes_every_worker_with_it():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
            import os, signal, sys, tether, pool_helpers
            if __name__ == "__main__":
                pool = tether.Pool(3)
                pool.submit(pool_helpers.square, 2).result()
                pool.submit(pool_helpers.sleep_then, 30)
                print(*pool.pids(), flush=True)
                sys.stdin.readline()
                os.kill(os.getpid(), signal.SIGKILL)
        """),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=HERE),
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 3 and all(alive(p) for p in pids)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(30) == -signal.SIGKILL
        assert wait_gone(pids, 1.0) == []
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stdin.close()


def test_dataloader_parent_killed_takes_leased_workers_with_it():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
            import os, signal, sys, tether, pool_helpers
            from torch.utils.data import DataLoader
            if __name__ == "__main__":
                pool = tether.Pool(2, start_method="fork")
                it = iter(DataLoader(pool_helpers.Squares(64, sleep=0.05), batch_size=1,
                                     num_workers=2, multiprocessing_context=pool.context()))
                next(it)
                print(*pool.pids(), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=HERE),
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert proc.wait(60) == -signal.SIGKILL
        assert len(pids) == 2 and wait_gone(pids, 1.0) == []
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


# -- leases: records the pool owns, waited for without polling ------------------------------


def _calls_to(name, fn):
    """How many times ``fn()`` calls a C function named ``name`` (a native wait)."""
    calls = []

    def profile(frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", None) == name:
            calls.append(arg)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return len(calls)


def test_a_queue_notices_a_dead_feeder_in_the_same_wait_as_the_data():
    with tether.Pool(1) as pool:
        _dead_feeder(pool)


def _dead_feeder(pool):
    ctx = pool.context()
    q = ctx.Queue()
    p = ctx.Process(target=helpers.hold, args=(q, 30))
    p.start()

    def empty_get():
        with pytest.raises(queue.Empty):
            q.get(timeout=0.3)

    assert _calls_to("recv_or_sentinel", empty_get) == 1  # one wait, no periodic wake-ups
    p.kill()
    with pytest.raises(RuntimeError, match=r"\(pid \d+\) was killed by signal SIGKILL"):
        q.get(timeout=30)
    p.join(10)
    assert p.exitcode == -signal.SIGKILL and not p.is_alive()
    q.close()


def test_join_waits_on_the_lease_and_the_sentinel_is_its_event(pool):
    import multiprocessing.connection

    ctx = pool.context()
    p = ctx.Process(target=helpers.sleep_then, args=(0.5,))
    p.start()
    assert _calls_to("wait", lambda: p.join(0.1)) == 1 and p.is_alive()
    assert multiprocessing.connection.wait([p.sentinel], timeout=30) == [p.sentinel]
    assert p.exitcode == 0 and not p.is_alive()


def test_a_pool_process_copied_into_a_fork_does_nothing_there(pool):
    ctx = pool.context()
    p = ctx.Process(target=helpers.sleep_then, args=(0.5,))
    p.start()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the fork
        p.terminate()
        p.kill()
        p.join(5)
        os._exit(0 if not p.is_alive() else 1)
    assert os.waitpid(child, 0)[1] == 0
    p.join(10)
    assert p.exitcode == 0  # the worker was not signalled


def test_the_pool_stores_nothing_on_a_dataloaders_objects(pool):
    torch_data = pytest.importorskip("torch.utils.data")
    it = iter(
        torch_data.DataLoader(
            helpers.Squares(8), num_workers=2, batch_size=2, multiprocessing_context=pool.context()
        )
    )
    next(it)
    assert set(vars(it._workers_done_event)) == {"_flag"}
    assert all(set(vars(q)) == {"_tx", "_rx", "_maxsize", "_feeders"} for q in it._index_queues)
    del it
    gc.collect()


def test_pool_context_and_channel_import_in_one_direction():
    import ast

    def imports(module):
        """The modules of tether.pool it imports (by name), and those of tether's other
        rooms (``tether.room.name``)."""
        path = os.path.join(os.path.dirname(tether.__file__), "pool", module + ".py")
        found = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found |= {node.module or a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tether."):
                found |= {f"{node.module}.{a.name}" for a in node.names}
        return found

    pool_modules = {"facade", "core", "tasks", "futures", "leases"}
    assert pool_modules.isdisjoint(imports("channel")) and "loader" not in imports("channel")
    assert pool_modules.isdisjoint(imports("loader")) and "channel" in imports("loader")
    assert {"loader", "tether.common.pickling"} <= set().union(*map(imports, pool_modules))


@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_a_worker_knows_its_parent_process_as_multiprocessings_workers_do(method):
    with tether.Pool(2, start_method=method) as pool:
        got = set(pool.map(helpers.parent_of_worker, range(8)))
    assert got == {(multiprocessing.current_process().name, os.getpid(), True)}
