"""A pool is shared, so a DataLoader never holds workers it will not use: an iterator whose
last ``next()`` raised gives its workers back to a task or another loader that waits (its
next ``next()`` says so), ``shutdown()`` always returns within its grace period and ends
every lease, a persistent loader alive at shutdown ends without torch's "killed by signal",
and a pool too small for a loader says so, once."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import textwrap
import time
import traceback

import pool_helpers as helpers
import pytest
from torch.utils.data import DataLoader

import tether
from tether.pool.runs import GRACE

pytestmark = pytest.mark.timeout(120)

HERE = os.path.dirname(os.path.abspath(__file__))
TAKEN_BACK = (
    r"the workers of this DataLoader iterator over Squares \(pid \d+, \d+\) were taken back "
    r"by the tether.Pool: "
)


def failing_loader(pool: tether.Pool) -> DataLoader:
    return DataLoader(
        helpers.Squares(16, fail_at=5),
        batch_size=2,
        num_workers=2,
        multiprocessing_context=pool.context(),
    )


def kept_failure(pool: tether.Pool, errors: list) -> object:
    """An iterator whose next() raised, its exception kept (as IPython keeps
    ``sys.last_value``), and with it the iterator."""
    it = iter(failing_loader(pool))
    try:
        for _ in it:
            pass
    except ValueError as exc:
        errors.append(exc)
    return it


def drain(it: object) -> None:
    for _ in range(16):
        next(it)  # type: ignore[call-overload]


def test_a_failed_iterator_whose_error_is_kept_gives_its_workers_to_a_waiting_task():
    errors: list = []
    with tether.Pool(2) as pool:
        it = kept_failure(pool, errors)
        assert all(w.lease is not None for w in pool._core.workers.workers())
        assert pool.submit(abs, -1).result(timeout=GRACE + 10) == 1
        with pytest.raises(RuntimeError) as info:
            drain(it)
        assert info.value.__cause__ is None
    assert errors
    message = str(info.value)
    assert re.match(TAKEN_BACK, message), message
    assert "its last next() raised ValueError, and a task was waiting for a worker" in message
    assert "Make a new iterator to go on" in message


def test_a_failed_iterator_whose_error_is_kept_gives_its_workers_to_the_next_loader():
    errors: list = []
    with tether.Pool(2) as pool:
        gc.disable()  # nothing but giving back frees the workers
        try:
            it = kept_failure(pool, errors)
            got = list(
                DataLoader(
                    helpers.Squares(8),
                    batch_size=4,
                    num_workers=2,
                    multiprocessing_context=pool.context(),
                )
            )
        finally:
            gc.enable()
        assert [b.tolist() for b in got] == [[0, 1, 4, 9], [16, 25, 36, 49]]
        with pytest.raises(
            RuntimeError,
            match=TAKEN_BACK + r"its last next\(\) raised ValueError, and a DataLoader "
            r"iterator over Squares asked for workers",
        ):
            drain(it)


def test_shutdown_returns_within_the_grace_period_while_iterators_hold_every_worker():
    errors: list = []
    pool = tether.Pool(2)
    failed = kept_failure(pool, errors)
    waiting = pool.submit(abs, -2)  # waits for a worker: the failed iterator has them
    live = iter(
        DataLoader(
            helpers.Squares(64, sleep=0.05),
            batch_size=2,
            num_workers=1,
            multiprocessing_context=pool.context(),
        )
    )
    start = time.monotonic()
    pool.shutdown()
    assert time.monotonic() - start < GRACE + 3
    assert waiting.result(timeout=0) == 2  # work given before shutdown still ran
    assert errors and failed is not None
    with pytest.raises(RuntimeError, match=r"the tether.Pool was shut down"):
        drain(live)


PERSISTENT = """
import sys, time
import pool_helpers as helpers
from torch.utils.data import DataLoader
import tether

errors = 0
for run in range({runs}):
    try:
        with tether.Pool(2) as pool:
            loader = DataLoader(helpers.Squares(32), batch_size=4, num_workers=2,
                                persistent_workers=True, multiprocessing_context=pool.context())
            for epoch in range(2):
                assert sum(len(batch) for batch in loader) == 32
        time.sleep(0.05)  # time for torch's SIGCHLD handler to speak
    except RuntimeError as exc:
        errors += 1
        print(f"run {{run}}: {{exc}}", file=sys.stderr)
print(f"{{errors}} of {{run + 1}} runs ended with an error")
"""


def test_a_persistent_loader_alive_at_shutdown_ends_without_killed_by_signal_in_50_runs():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    got = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PERSISTENT.format(runs=50))],
        capture_output=True,
        text=True,
        timeout=110,
        env=env,
    )
    assert "killed by signal" not in got.stderr, got.stderr[-3000:]
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout.split()[:4] == ["0", "of", "50", "runs"], got.stdout + got.stderr[-3000:]


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_more_workers_than_the_pool_has_is_one_unchained_error_that_says_it_is_too_small():
    with tether.Pool(2) as pool:
        with pytest.raises(tether.NoFreeWorkerError) as info:
            iter(
                DataLoader(
                    helpers.Squares(8), num_workers=3, multiprocessing_context=pool.context()
                )
            )
    error = info.value
    assert error.__cause__ is None and error.__context__ is None
    printed = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    assert printed.count("tether.errors.NoFreeWorkerError:") == 1
    assert "During handling of the above exception" not in printed
    assert str(error) == (
        "tether.Pool(processes=2) cannot lease 3 worker(s) for a DataLoader with num_workers=3: "
        "the pool has only 2 workers. Make the pool larger (tether.Pool(3) or more), or lower "
        "num_workers to 2 or less."
    )


def test_workers_held_by_another_loader_is_one_unchained_error_that_names_it():
    with tether.Pool(2) as pool:
        held = iter(
            DataLoader(helpers.Squares(8), num_workers=1, multiprocessing_context=pool.context())
        )
        next(held)
        with pytest.raises(tether.NoFreeWorkerError) as info:
            iter(
                DataLoader(
                    helpers.Squares(8), num_workers=2, multiprocessing_context=pool.context()
                )
            )
        error = info.value
        assert error.__cause__ is None and error.__context__ is None
        message = str(error)
        assert f"1 by DataLoader iterator(s) over Squares (pid {held._workers[0].pid})" in message
        assert "Finish or delete the other iterations" in message
        del held
