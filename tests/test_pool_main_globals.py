"""``pool.context()`` gives what torch's fork workers give for what a script's main block set:
``pool_main_script.py`` runs as ``__main__`` (globals set in the main block, rebound between
loaders, read through helpers; lambdas, closures, local functions and partials as transforms,
``collate_fn`` and ``worker_init_fn``; tensor, array and class caches that workers write,
through views and ``.numpy()``), three loaders per case, on fork and on a pool, and every
batch of every loader and the parent's objects afterwards must be the same."""

from __future__ import annotations

from pathlib import Path

import pytest
from pool_helpers import run_main_script

pytestmark = pytest.mark.timeout(300)

SCRIPT = Path(__file__).with_name("pool_main_script.py")


@pytest.fixture(scope="module")
def results():
    return run_main_script(SCRIPT)


def test_every_case_gives_every_batch_fork_gives_and_leaves_the_parent_as_fork_does(results):
    cases = {name: got for name, got in results.items() if name not in ("unpicklable", "raises")}
    assert len(cases) == 36
    wrong = [
        f"{name}:\n  fork: {got['fork']}\n  pool: {got['pool']}"
        for name, got in cases.items()
        if got["fork"] != got["pool"]
    ]
    assert not wrong, f"{len(wrong)} of {len(cases)} cases differ:\n" + "\n".join(wrong)


def test_a_cache_workers_write_never_reaches_the_parent(results):
    caches = {name: got for name, got in results.items() if name.startswith("cache_")}
    assert caches
    assert all(got["pool"]["parent"] == 0.0 for got in caches.values()), caches
    # What a worker wrote is undone before its next lease: every epoch reads 1.
    assert all(
        batch == [1.0] * len(batch)
        for name, got in caches.items()
        if not name.startswith("cache_view")
        for epoch in got["pool"]["batches"]
        for batch in epoch
    )


def test_a_global_that_cannot_travel_is_named_never_read_at_its_import_time_value(results):
    said = results["unpicklable"]
    assert said.startswith("PicklingError: the global 'LOCK' of __main__ (a lock)"), said
    assert "ReadsLock.__getitem__" in said


def test_a_worker_traceback_names_the_scripts_file_and_line_as_fork_does(results):
    fork, pool = results["raises"]["fork"], results["raises"]["pool"]
    assert any('pool_main_script.py", line' in line and "__getitem__" in line for line in fork)
    assert pool == fork
