"""An unmodified ``torch.utils.data.DataLoader`` on ``pool.context()``: the batches are those
of ``num_workers=0``, every DataLoader option keeps working, workers are reused and hold
nothing of a previous loader, and a worker that fails or dies gives torch's error and is
replaced."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import signal
import threading
import time

import pool_cases
import pool_datasets as pdata
import pool_helpers as helpers
import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils import signal_handling

import tether
from conftest import child_pids, session_pids, shm_entries, wait_gone

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pool():
    # Two spawn workers, shared by the module; torch is imported there once.
    with tether.Pool(2, preload=["torch"]) as pool:
        yield pool


def loader(pool, dataset, **kwargs):
    kwargs.setdefault("num_workers", 2)
    return DataLoader(dataset, multiprocessing_context=pool.context(), **kwargs)


def same_batches(a, b):
    a, b = list(a), list(b)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert x == y


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("batch_size", [1, 5, 16])
def test_map_style_batches_equal_num_workers_0(pool, batch_size, drop_last):
    dataset = helpers.Squares(50)
    expected = DataLoader(dataset, batch_size=batch_size, drop_last=drop_last)
    same_batches(loader(pool, dataset, batch_size=batch_size, drop_last=drop_last), expected)


def test_tensors_shuffle_and_prefetch(pool):
    dataset = pdata.Tensors(64)
    expected = DataLoader(
        dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3)
    )
    got = loader(
        pool,
        dataset,
        batch_size=8,
        shuffle=True,
        prefetch_factor=4,
        generator=torch.Generator().manual_seed(3),
    )
    same_batches(got, expected)


def test_iterable_dataset(pool):
    dataset = pdata.Stream(50)
    got = sorted(int(x) for batch in loader(pool, dataset, batch_size=4) for x in batch)
    assert got == list(range(50))


def test_in_order_false_gives_the_same_items(pool):
    dataset = helpers.Squares(40)
    got = sorted(int(x) for b in loader(pool, dataset, batch_size=3, in_order=False) for x in b)
    assert got == [i * i for i in range(40)]


def test_collate_fn_worker_init_fn_and_worker_info(pool):
    got = list(loader(pool, helpers.Squares(8), batch_size=4, collate_fn=helpers.pair_collate))
    assert got == [("custom", [0, 1, 4, 9]), ("custom", [16, 25, 36, 49])]
    rows = [
        row
        for batch in loader(
            pool,
            helpers.Probe(),
            batch_size=2,
            worker_init_fn=helpers.mark_init,
            generator=torch.Generator().manual_seed(11),
        )
        for row in zip(*batch)
    ]
    base = {int(r[2]) - int(r[0]) for r in rows}
    assert len(base) == 1  # seed = base_seed + worker id
    for worker_id, num_workers, _, _, init_mark, ppid in rows:
        assert int(num_workers) == 2
        assert int(init_mark) == int(worker_id)  # worker_init_fn ran in that worker
        assert int(ppid) == os.getpid()  # a direct child: torch's getppid watchdog holds


def test_seeds_follow_the_loader_not_the_worker_history(pool):
    def draws():
        return torch.cat(
            list(
                loader(
                    pool,
                    pdata.RandomDraws(),
                    batch_size=2,
                    generator=torch.Generator().manual_seed(5),
                )
            )
        )

    first, second = draws(), draws()
    assert torch.equal(first, second)


def test_timeout(pool):
    slow = loader(pool, helpers.Squares(4, sleep=1.5), batch_size=1, timeout=0.3)
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after 0.3 seconds"):
        list(slow)
    gc.collect()


def test_persistent_workers_keep_their_workers_between_epochs(pool):
    dl = loader(pool, helpers.Squares(20), batch_size=4, persistent_workers=True)
    expected = list(DataLoader(helpers.Squares(20), batch_size=4))
    for _ in range(3):
        same_batches(dl, expected)
    pids = {w.pid for w in dl._iterator._workers}
    assert pids <= set(pool.pids())
    del dl
    gc.collect()
    # The workers are free again: a loader wanting both of them starts.
    same_batches(loader(pool, helpers.Squares(20), batch_size=4), expected)


def test_pin_memory(pool):
    dataset = pdata.Tensors(16)
    with pytest.warns() if not torch.accelerator.is_available() else contextlib.nullcontext():
        same_batches(
            loader(pool, dataset, batch_size=4, pin_memory=True), DataLoader(dataset, batch_size=4)
        )


def test_more_than_250_tensors_in_one_batch(pool):
    batches = list(loader(pool, pdata.ManyTensors(), batch_size=1, num_workers=1))
    assert len(batches) == 2
    assert float(batches[1][299][0][0]) == 1299.0


def test_workers_are_reused_and_direct_children(pool):
    pids = set(pool.pids())
    assert pids <= child_pids()
    seen = set()
    for _ in range(5):
        dl = loader(pool, helpers.Probe(), batch_size=4)
        it = iter(dl)
        seen |= {w.pid for w in it._workers}
        list(it)
    assert seen == pids
    assert set(pool.pids()) == pids


def test_nothing_of_a_dropped_loader_stays_in_the_worker(pool):
    list(loader(pool, helpers.Squares(16), batch_size=4, worker_init_fn=helpers.mark_init))
    # The workers drop the dataset once the parent does (the pool keeps a dataset only
    # while this process holds it).
    list(loader(pool, pdata.Tensors(4), batch_size=2))
    # Both workers, after an idle moment: no worker info, no dataset alive.
    time.sleep(0.5)
    states = set(pool.map(helpers.worker_state, range(8)))
    for pid, info_clear, live in states:
        assert pid in pool.pids()
        assert info_clear
        assert live == 0


@pytest.mark.parametrize("batch_size", [4, None], ids=["batched", "unbatched"])
def test_empty_tensors_arrive_as_with_fork(pool, batch_size):
    got = list(loader(pool, pdata.Empties(), batch_size=batch_size))
    fork = DataLoader(pdata.Empties(), batch_size=batch_size, num_workers=2)
    expected = list(fork)
    assert [tuple(b.shape) for b in got] == [tuple(b.shape) for b in expected]
    same_batches(got, expected)


def test_two_loaders_at_once(pool):
    train = loader(pool, helpers.Squares(12), batch_size=3, num_workers=1)
    val = loader(pool, pdata.Tensors(8), batch_size=2, num_workers=1)
    pairs = list(zip(train, val))
    assert len(pairs) == 4
    same_batches([a for a, _ in pairs], list(DataLoader(helpers.Squares(12), batch_size=3)))
    same_batches([b for _, b in pairs], list(DataLoader(pdata.Tensors(8), batch_size=2)))


def test_more_workers_than_free_is_a_clear_error(pool):
    held = iter(loader(pool, helpers.Squares(8), batch_size=1, num_workers=1))
    next(held)
    with pytest.raises(RuntimeError) as info:
        iter(loader(pool, helpers.Squares(8), batch_size=1, num_workers=2))
    message = str(info.value)
    assert "tether.Pool(processes=2)" in message
    assert "num_workers=2" in message and "1 are leased" in message
    assert "Squares" in message and str(held._workers[0].pid) in message
    del held
    gc.collect()
    assert len(list(loader(pool, helpers.Squares(8), batch_size=4))) == 2


def test_views_of_one_tensor_a_worker_made_share_one_memory_as_with_torch(pool):
    # batch_size=None: each item is a 16 KiB view of the same 64 MiB tensor; all are kept.
    def kept(context):
        return list(
            DataLoader(
                pool_cases.Views(), batch_size=None, num_workers=1, multiprocessing_context=context
            )
        )

    def shared_bytes(views):
        storages = {v.untyped_storage().data_ptr(): v.untyped_storage() for v in views}
        assert all(s.is_shared() for s in storages.values())
        return sum(s.nbytes() for s in storages.values())

    forked, pooled = kept("fork"), kept(pool.context())
    assert len(pooled) == 16
    assert all(torch.equal(a, b) for a, b in zip(pooled, forked))
    assert shared_bytes(forked) == pool_cases.Views.SIZE
    assert shared_bytes(pooled) <= shared_bytes(forked)


def test_dataset_exception_reaches_the_main_process(pool):
    with pytest.raises(ValueError, match=r"bad item 5") as info:
        list(loader(pool, helpers.Squares(16, fail_at=5), batch_size=2))
    assert "Caught ValueError in DataLoader worker process" in str(info.value)
    del info  # its traceback holds the iterator, which holds its workers
    gc.collect()
    assert len(list(loader(pool, helpers.Squares(16), batch_size=4))) == 4


def test_break_early_never_yields_a_stale_batch(pool):
    expected = list(DataLoader(helpers.Squares(40), batch_size=4))
    for stop in range(1, 4):
        for i, batch in enumerate(loader(pool, helpers.Squares(40), batch_size=4)):
            assert torch.equal(batch, expected[i])
            if i == stop:
                break
    same_batches(loader(pool, helpers.Squares(40), batch_size=4), expected)


def _counts():
    gc.collect()
    return (
        len(child_pids()),
        threading.active_count(),
        len(os.listdir("/proc/self/fd")),
        len(shm_entries(session_pids())),
    )


def test_200_loaders_leave_counts_flat(pool):
    for _ in range(5):
        list(loader(pool, pdata.Tensors(16), batch_size=4))
    before = _counts()
    for i in range(200):
        count = sum(
            1
            for _ in loader(pool, pdata.Tensors(16) if i % 2 else helpers.Squares(16), batch_size=4)
        )
        assert count == 4
    assert _counts() == before


@pytest.mark.parametrize(
    "how, pattern",
    [
        ("sigkill", r"is killed by signal: Killed"),
        ("segfault", r"is killed by signal: Segmentation fault"),
        ("exit", r"exited unexpectedly with exit code 7"),
    ],
)
def test_worker_death_is_reported_and_healed(how, pattern):
    # A fork pool of its own: torch is already imported here, so its workers cost nothing.
    with tether.Pool(2, start_method="fork") as pool:
        before = set(pool.pids())
        started = time.monotonic()
        # torch's words: its SIGCHLD handler's message, or the data wait's, which names the
        # same failure as its cause.
        with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid(\(s\))? \d+\)") as info:
            list(loader(pool, helpers.Squares(64, crash_at=20, crash_how=how), batch_size=4))
        assert time.monotonic() - started < 10
        dead = int(re.search(r"pid(?:\(s\))? (\d+)", str(info.value)).group(1))
        assert dead in before
        failure = f"{info.value} {info.value.__cause__}"
        assert re.search(pattern, failure) and f"pid {dead})" in failure
        del info
        gc.collect()
        assert dead not in pool.pids()
        same_batches(
            loader(pool, helpers.Squares(16), batch_size=4),
            DataLoader(helpers.Squares(16), batch_size=4),
        )
        assert len(pool.pids()) == 2


def test_terminate_of_a_pool_process_kills_only_its_worker():
    with tether.Pool(2, start_method="fork") as pool:
        it = iter(loader(pool, helpers.Squares(8, sleep=0.2), batch_size=1))
        victim = it._workers[0]
        pid = victim.pid
        # As torch does before it stops its own workers: its SIGCHLD handler would otherwise
        # report the death it sees (when it sees it before tether's warden reaps it).
        signal_handling._remove_worker_pids(id(it))
        it._worker_pids_set = False
        victim.terminate()
        victim.join(5)
        # torch's worker SIGTERM handler exits 0 when its parent sends the signal.
        assert victim.exitcode in (0, -signal.SIGTERM) and not victim.is_alive()
        del it, victim
        gc.collect()
        assert pid not in pool.pids()
        gc.collect()
        assert len(list(loader(pool, helpers.Squares(8), batch_size=4))) == 2


def test_a_context_keeps_its_pool_alive():
    pool = tether.Pool(2)
    context, pids = pool.context(), pool.pids()
    del pool  # only the context is kept, as a DataLoader keeps it
    gc.collect()
    loaded = DataLoader(
        helpers.Squares(8), batch_size=4, num_workers=2, multiprocessing_context=context
    )
    assert len(list(loaded)) == 2
    del loaded, context
    gc.collect()
    assert wait_gone(pids, 5.0) == [], "the pool outlived its last context"
