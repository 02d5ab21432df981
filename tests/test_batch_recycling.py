"""Batch storages go back to the pool worker that made them once nothing reads them, and are
reused for its next batches: never while a tensor, a view or an array of the batch lives,
in this process, in the worker or in another process it was sent to."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pool_datasets as pdata
import pytest
import torch
from torch.utils.data import DataLoader

import tether
from tether.pool.recycle_page import SLOTS

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).resolve().parent
BATCH = 16


@pytest.fixture(scope="module")
def pool():
    with tether.Pool(2) as pool:
        yield pool


def loader(pool, n_batches, **kwargs):
    """``n_batches`` batches (of ``BATCH`` items unless told) of ``Filled`` items."""
    kwargs.setdefault("batch_size", BATCH)
    return DataLoader(
        pdata.Filled(kwargs["batch_size"] * n_batches),
        num_workers=2,
        multiprocessing_context=pool.context(),
        **kwargs,
    )


def storage_id(batch):
    """The memfd of a batch's storage, by its inode."""
    fd, _ = batch.untyped_storage()._share_fd_cpu_()
    return os.fstat(fd).st_ino


def test_storages_of_dropped_batches_are_reused(pool):
    storages = set()
    count = 0
    for i, batch in enumerate(loader(pool, 60)):
        assert pdata.holds(batch, i * BATCH)
        storages.add(storage_id(batch))
        count += 1
        del batch
    assert count == 60
    assert len(storages) <= 16, f"{len(storages)} storages for 60 batches"


def test_a_batch_kept_while_later_batches_arrive_is_never_overwritten(pool):
    kept = []
    for i, batch in enumerate(loader(pool, 60)):
        first = i * BATCH
        if i % 5 == 0:
            kept.append(("batch", first, batch))
        elif i % 5 == 1:
            kept.append(("view", first + 2, batch[2:9]))
        elif i % 5 == 2:
            kept.append(("array", first, batch.numpy()))
        del batch
    assert len(kept) == 36
    for kind, first, value in kept:
        tensor = torch.from_numpy(value) if kind == "array" else value
        assert pdata.holds(tensor, first), (kind, first)


def test_batches_of_changing_sizes_are_whole(pool):
    sizes = [16, 16, 5, 16, 33, 5, 16, 1, 33, 16] * 4
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    batches = [list(range(start, start + size)) for start, size in zip(starts, sizes)]
    kept = []
    changing = DataLoader(
        pdata.Filled(sum(sizes)),
        batch_sampler=batches,
        num_workers=2,
        multiprocessing_context=pool.context(),
    )
    for k, batch in enumerate(changing):
        assert len(batch) == sizes[k]
        assert pdata.holds(batch, starts[k]), k
        if k % 3 == 0:
            kept.append((starts[k], batch))
        del batch
    assert all(pdata.holds(batch, first) for first, batch in kept)


def test_the_next_loader_takes_back_the_storages_the_last_one_dropped(pool):
    made = set()
    for batch in loader(pool, 12):
        made.add(storage_id(batch))
        del batch
    # The workers keep them (alive, so no new memfd can take their inodes) for their next
    # lease: its first batches are made in them.
    again = []
    for i, batch in enumerate(loader(pool, 4)):
        assert pdata.holds(batch, i * BATCH)
        again.append(storage_id(batch))
        del batch
    assert again[0] in made, (again, made)


def test_batches_kept_from_the_last_loader_are_never_reused_by_the_next(pool):
    kept = list(loader(pool, 12))
    for i, batch in enumerate(loader(pool, 12)):
        assert pdata.holds(batch, i * BATCH)
        del batch
    assert all(pdata.holds(batch, i * BATCH) for i, batch in enumerate(kept))


def _one_loader_through(pool):
    """Runs a loader to its end; its workers' pids."""
    it = iter(loader(pool, 12))
    workers = [w.pid for w in it._workers]
    for _ in it:
        pass
    return workers


def test_an_idle_worker_lets_its_kept_storages_go(pool):
    workers = _one_loader_through(pool)
    gc.collect()
    deadline = time.monotonic() + 10
    while any(_fds(pid).get(TENSOR, 0) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [_fds(pid).get(TENSOR, 0) for pid in workers] == [0, 0]


def test_a_worker_that_runs_an_executor_task_lets_its_kept_storages_go(pool):
    workers = _one_loader_through(pool)
    ran = set()
    deadline = time.monotonic() + 30
    while not ran.issuperset(workers) and time.monotonic() < deadline:
        ran.update(pool.map(_pid, range(4)))
    assert [_fds(pid).get(TENSOR, 0) for pid in workers] == [0, 0]


def _pid(_):
    return os.getpid()


def _release_pages_mapped():
    with open("/proc/self/maps") as maps:
        return sum("tether release page" in line for line in maps)


def test_this_process_keeps_the_last_few_release_pages_mapped():
    from tether.pool import recycle

    gc.collect()
    recycle.release_gone()
    before = _release_pages_mapped()  # of the pools of the tests before this one
    for pools in range(1, 7):
        with tether.Pool(2) as pool:
            for batch in loader(pool, 6):
                del batch
            recycle.release_gone()  # every batch is gone: no storage follows a page now
            # The pool's two pages stay mapped for its next loader; older ones go.
            assert _release_pages_mapped() == min(before + 2 * pools, recycle.IDLE_PAGES)


def test_a_batch_the_worker_still_holds_is_never_reused(pool):
    # This process drops every batch at once: only the worker holds them.
    intact = [
        intact
        for _, intact in DataLoader(
            pdata.Filled(BATCH * 30),
            batch_size=BATCH,
            num_workers=2,
            collate_fn=pdata.CollateKeepingLast(),
            multiprocessing_context=pool.context(),
        )
    ]
    assert intact == [True] * 30


@pytest.mark.parametrize("how", ["queue", "fork"])
def test_a_batch_another_process_received_stays_intact_after_this_one_drops_it(how):
    # On a torch.multiprocessing queue, or in a child forked while this process held it.
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    got = subprocess.run(
        [sys.executable, str(HERE / "scripts" / "reshared_batch.py"), how],
        env=dict(os.environ, PYTHONPATH=path),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout.split() == ["intact", "True"]


def test_a_batch_outlives_the_worker_that_made_it():
    with tether.Pool(2) as pool:
        it = iter(loader(pool, 20))
        first = next(it)
        maker = it._workers[0].pid  # batch 0 is worker 0's
        # Inside the block: torch's SIGCHLD handler may raise at the very next line.
        with pytest.raises(RuntimeError, match=f"DataLoader worker \\(pid.* {maker}\\)"):
            os.kill(maker, signal.SIGKILL)
            for _ in range(20):
                next(it)
        del it
        assert pdata.holds(first, 0)
        for i, batch in enumerate(loader(pool, 6)):
            assert pdata.holds(batch, i * BATCH)


def _fds(pid):
    """The fds ``pid`` holds, by kind: a batch's storage is ``"/memfd:a tensor (deleted)"``."""
    counts: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            kind = os.readlink(f"/proc/{pid}/fd/{fd}").split("[")[0]
        except FileNotFoundError:  # the listing's own fd
            continue
        counts[kind] = counts.get(kind, 0) + 1
    return counts


TENSOR = "/memfd:a tensor (deleted)"


def _rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_fds_and_memory_stay_flat_over_many_batches(pool):
    gc.collect()
    at_start = _fds(os.getpid())
    it = iter(loader(pool, 400, batch_size=BATCH * 4))
    workers = [w.pid for w in it._workers]
    in_flight = it._prefetch_factor * len(workers)
    samples = []
    for i in range(400):
        batch = next(it)
        assert pdata.holds(batch, i * BATCH * 4)
        del batch
        if i in (40, 399):
            fds = _fds(os.getpid())
            # Batches that came ahead of their turn wait in the loader, each with its storage.
            assert fds.pop(TENSOR, 0) <= in_flight, fds
            # A worker keeps at most SLOTS storages to reuse, more of them as its batches come back.
            worker_fds = [_fds(p) for p in workers]
            assert all(w.pop(TENSOR, 0) <= SLOTS for w in worker_fds), worker_fds
            samples.append((fds, worker_fds, [_rss_kib(p) for p in workers]))
    del it
    gc.collect()
    (fds, worker_fds, rss), (fds_after, worker_fds_after, rss_after) = samples
    assert fds_after == fds
    assert worker_fds_after == worker_fds
    assert _fds(os.getpid()) == at_start
    grown = [after - before for before, after in zip(rss, rss_after)]
    assert max(grown) < 8 * 1024, f"workers' RSS grew by {grown} KiB"
