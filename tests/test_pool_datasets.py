"""DataLoaders over datasets of real size on ``pool.context()``: a dataset crosses to the
workers once and stays there while the parent holds it (``keep_datasets=True``, the
default), or once per loader, as fork would show it (``keep_datasets=False``); the pool
notices what the parent changes; big buffers travel in shared memory; batches never need
``/dev/shm``."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pool_datasets as pdata
import pool_helpers as helpers
import pytest
import torch
from torch.utils.data import DataLoader

import tether

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).resolve().parent


@pytest.fixture
def pool():
    with tether.Pool(2) as pool:
        yield pool


def items(pool, dataset, keep=True, **kwargs):
    """Every item of one loader over ``dataset`` (2 workers, no batching)."""
    kwargs.setdefault("num_workers", 2)
    context = pool.context(keep_datasets=keep)
    return list(DataLoader(dataset, batch_size=None, multiprocessing_context=context, **kwargs))


def unpicklings(got):
    """{worker pid: how many times a Counted was unpickled there}, as the last items say."""
    seen = {}
    for pid, count, *_ in got:
        seen[pid] = max(count, seen.get(pid, 0))
    return seen


def test_a_dataset_is_unpickled_once_per_worker_over_many_loaders(pool):
    dataset = helpers.Counted(8)
    before = helpers.COUNTS["pickled"]
    for _ in range(6):
        got = items(pool, dataset)
        assert [i for *_, i in got] == list(range(8))
    assert unpicklings(got) == {pid: 1 for pid in pool.pids()}
    assert helpers.COUNTS["pickled"] - before == 1  # once, for both workers


def test_without_keeping_a_dataset_is_pickled_once_per_loader(pool):
    dataset = helpers.Counted(8)
    before = helpers.COUNTS["pickled"]
    for loader in range(1, 5):
        got = items(pool, dataset, keep=False)
        assert helpers.COUNTS["pickled"] - before == loader
        assert unpicklings(got) == {pid: loader for pid in pool.pids()}


def test_a_rebound_attribute_is_seen_by_the_next_loader(pool):
    dataset = helpers.Counted(4, tag="first")
    assert {tag for _, _, tag, *_ in items(pool, dataset)} == {"first"}
    dataset.tag = "second"
    assert {tag for _, _, tag, *_ in items(pool, dataset)} == {"second"}
    dataset.words = ["new", "list"]
    assert {tuple(words) for *_, words, _ in items(pool, dataset)} == {("new", "list")}


def test_a_tensor_changed_in_place_is_seen_by_the_next_loader(pool):
    dataset = pdata.HoldsTensor(torch.zeros(4))
    first = items(pool, dataset)
    # In place: torch moved its storage to shared memory when it was first pickled, so the
    # workers read the parent's very memory; nothing needs to be sent again.
    dataset.values.add_(1)
    second = items(pool, dataset)
    # In place onto a new storage, which the workers do not share (torch's own resize_ of
    # a shared storage crashes): sent again.
    dataset.values.set_(torch.full((8,), 2.0).untyped_storage())
    third = items(pool, dataset)
    assert {float(x[0]) for x in first} == {0.0}
    assert {float(x[0]) for x in second} == {4.0}
    assert {float(x[0]) for x in third} == {16.0}
    assert {float(x[1]) for x in second} == {1.0} and {float(x[1]) for x in third} == {2.0}


def test_a_change_in_place_is_seen_by_the_next_loader_and_refresh_sends_again(pool):
    dataset = helpers.Counted(4, words=["a"])
    assert {tuple(w) for *_, w, _ in items(pool, dataset)} == {("a",)}
    dataset.words.append("b")  # in place, inside a list
    got = items(pool, dataset)
    assert {tuple(w) for *_, w, _ in got} == {("a", "b")}
    assert set(unpicklings(got).values()) == {2}
    # Unchanged: nothing is sent; refreshed: sent again (its __setstate__ runs again).
    assert set(unpicklings(items(pool, dataset)).values()) == {2}
    pool.refresh(dataset)
    assert set(unpicklings(items(pool, dataset)).values()) == {3}
    pool.refresh()  # every dataset
    assert set(unpicklings(items(pool, dataset)).values()) == {4}


def test_without_keeping_every_iterator_sees_the_dataset_as_fork_does(pool):
    def run(context):
        dataset = helpers.Counted(4, words=["a"])
        seen = []
        for change in (None, "b", "c"):
            if change is not None:
                dataset.words.append(change)
            loader = DataLoader(
                dataset, batch_size=None, num_workers=2, multiprocessing_context=context
            )
            seen.append(sorted({(tag, tuple(w), int(i)) for _, _, tag, w, i in loader}))
        return seen

    assert run(pool.context(keep_datasets=False)) == run("fork")


def test_two_datasets_of_one_class_never_mix(pool):
    a, b = helpers.Counted(4, tag="a"), helpers.Counted(4, tag="b")
    for _ in range(3):
        assert {tag for _, _, tag, *_ in items(pool, a)} == {"a"}
        assert {tag for _, _, tag, *_ in items(pool, b)} == {"b"}


def test_a_new_dataset_at_a_freed_address_is_a_new_dataset(pool):
    reused, address = 0, None
    for tag in range(12):
        dataset = helpers.Counted(4, tag=tag)
        reused += id(dataset) == address
        assert {t for _, _, t, *_ in items(pool, dataset)} == {tag}
        address = id(dataset)
        del dataset
    assert reused > 0  # CPython gave a freed address to a new dataset at least once


def test_workers_drop_a_dataset_as_soon_as_the_parent_drops_it(pool):
    dataset = helpers.Squares(16)
    assert len(items(pool, dataset)) == 16
    pids = set(pool.pids())
    live = {pid: 1 for pid in pids}
    del dataset
    # No loader follows: the pool tells both workers at once (a note each reads while idle).
    deadline = time.monotonic() + 10
    while any(live.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
        live.update({pid: n for pid, _, n in pool.map(helpers.worker_state, range(16))})
    assert set(live) == pids and set(live.values()) == {0}, live
    # A later loader still serves (and the dropped dataset's key names nothing).
    assert len(items(pool, helpers.Counted(4))) == 4


def test_nothing_of_a_loader_without_keeping_stays_in_the_worker(pool):
    dataset = helpers.Squares(16)
    assert len(items(pool, dataset, keep=False)) == 16
    states = {pid: live for pid, _, live in pool.map(helpers.worker_state, range(16))}
    assert set(states.values()) == {0}


@pytest.mark.slow  # ten loaders over a large dataset, memory measured after each
@pytest.mark.parametrize("same", [True, False], ids=["same-dataset", "new-dataset-each-time"])
def test_workers_memory_stays_flat_over_ten_loaders(pool, same):
    dataset = helpers.Samples(300_000)
    rss = []
    for _ in range(10):
        if not same:
            dataset = helpers.Samples(300_000)
        loader = DataLoader(
            dataset,
            batch_size=1000,
            num_workers=2,
            multiprocessing_context=pool.context(),
            sampler=range(0, 300_000, 3000),
        )
        assert sum(len(batch) for batch in loader) == 100
        rss.append(dict(pool.map(helpers.rss_kib, range(8))))
    grown = [rss[-1][pid] - rss[2][pid] for pid in rss[-1] if pid in rss[2]]
    assert grown and max(grown) < 20 * 1024, f"workers' RSS grew by {grown} KiB"


def test_large_buffers_are_shared_memory_the_workers_map(pool):
    np = pytest.importorskip("numpy")
    array = np.arange(4 * 2**20 // 8, dtype=np.float64) + 7
    for keep in (True, False):
        ((first, writable, in_memfd),) = [
            x.tolist() for x in items(pool, pdata.HoldsArray(array), keep=keep, num_workers=1)
        ]
        assert (first, writable, in_memfd) == (7.0, 1.0, 1.0)


def _in_small_dev_shm(mode, tmp):
    """Runs tests/scripts/big_batches.py with a 64 MiB /dev/shm of its own (a private mount
    namespace, as in a container with Docker's default)."""
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, TMPDIR=str(tmp))
    script = HERE / "scripts" / "big_batches.py"
    command = f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} {script} {mode}"
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", command],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )


@pytest.mark.slow  # batches larger than a small /dev/shm, with torch and with the pool
def test_big_batches_need_no_dev_shm_where_torch_fork_fails():
    # A short temporary directory of its own (multiprocessing's sockets live there), which
    # goes with whatever torch's failed workers leave in it.
    with tempfile.TemporaryDirectory(prefix="shm") as tmp:
        control = _in_small_dev_shm("fork", tmp)
        got = _in_small_dev_shm("pool", tmp)
    assert control.returncode != 0 and "shared memory" in control.stderr, control.stderr[-2000:]
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout.split() == ["batches", "12"]


def test_shared_memory_that_runs_out_is_an_error_naming_the_worker_and_the_size(pool):
    loader = DataLoader(
        pdata.Images(8),
        batch_size=4,
        num_workers=1,
        worker_init_fn=pdata.refuse_shared_memory,
        multiprocessing_context=pool.context(),
    )
    it = iter(loader)
    with pytest.raises(MemoryError) as info:
        next(it)
    text = str(info.value)
    # The error's traceback holds this frame, which holds the error: without the collector
    # the iterator would keep its workers leased until the pool shuts down (and kills them).
    del info, it
    assert all(w.lease is None for w in pool._core.workers.workers())
    assert "in DataLoader worker process 0" in text
    pids = "|".join(map(str, pool.pids()))
    assert re.search(
        rf"tether.Pool worker \(pid ({pids})\) cannot allocate 2408448 bytes \(2.3 MiB\) of "
        r"shared memory \(a memfd\) for a tensor: Cannot allocate memory",
        text,
    ), text


def test_an_iterator_that_raised_and_was_dropped_gives_its_workers_back_at_once(pool):
    gc.disable()  # without the garbage collector: nothing but reference counting frees it
    try:
        with pytest.raises(ValueError, match="Caught ValueError in DataLoader worker"):
            for _ in DataLoader(
                helpers.Squares(16, fail_at=5),
                batch_size=2,
                num_workers=2,
                multiprocessing_context=pool.context(),
            ):
                pass
        leased = [w.lease for w in pool._core.workers.workers()]
        assert leased == [None, None]
        assert pool.submit(helpers.square, 3).result(timeout=10) == 9
    finally:
        gc.enable()


def test_an_executor_task_never_waits_on_workers_a_garbage_iterator_holds(pool):
    gc.disable()  # the cycle below is only ever collected by the pool itself
    try:
        it = iter(
            DataLoader(
                helpers.Squares(16),
                batch_size=2,
                num_workers=2,
                multiprocessing_context=pool.context(),
            )
        )
        next(it)
        cycle = [it]
        cycle.append(cycle)
        del it, cycle
        assert all(w.lease is not None for w in pool._core.workers.workers())
        assert pool.submit(helpers.square, 3).result(timeout=10) == 9
    finally:
        gc.enable()


def test_what_the_dataset_and_its_own_methods_share_stays_shared_in_every_loader(pool):
    # torch pickles a worker's arguments together: worker_init_fn.__self__ is the dataset
    # the worker iterates. A bound method is a new object at every attribute access, yet
    # the dataset crosses once.
    dataset = helpers.InitsItself(8)
    before = helpers.COUNTS["pickled"]
    for keep in (True, True, True, False):
        loader = DataLoader(
            dataset,
            batch_size=2,
            num_workers=2,
            worker_init_fn=dataset.init,
            collate_fn=dataset.collate,
            multiprocessing_context=pool.context(keep_datasets=keep),
        )
        items = [item for batch in loader for item in batch]
        assert len(items) == 8
        assert all(inited == worker for inited, worker, _, _ in items), items
    assert helpers.COUNTS["pickled"] - before == 2  # the first loader, and keep_datasets=False
