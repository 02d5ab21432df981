"""Shared fixtures: every test must leave no child process, fd, temp file or shared-memory
segment behind."""

from __future__ import annotations

import gc
import multiprocessing
import os
import tempfile
import time
from typing import Dict, Iterator, List, Set

import pytest

# Everything this session and its children put in the temporary directory lands in a
# private one, checked after every test and removed at the end: the check then sees only
# what the tests left, whatever else runs on the machine.
# (Children that import this module share their parent's.)
_PRIVATE_TMP = os.environ.get("TETHER_TESTS_TMP") or tempfile.mkdtemp(prefix="tether-tests-")
os.environ["TETHER_TESTS_TMP"] = os.environ["TMPDIR"] = tempfile.tempdir = _PRIVATE_TMP


def child_pids(parent: int = 0) -> Set[int]:
    """Live (non-zombie and zombie) children of ``parent`` (this process by default)."""
    parent = parent or os.getpid()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[1]) == parent:
            found.add(int(entry))
    return found


def stray_children() -> Set[int]:
    """Live children of this process other than the resource tracker and the zygotes."""
    from multiprocessing import resource_tracker

    from tether import _zygote

    helpers = {getattr(resource_tracker._resource_tracker, "_pid", None), *_zygote.pids()}
    return {p for p in child_pids() if p not in helpers and alive(p)}


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def wait_gone(pids: List[int], limit: float) -> List[int]:
    """Waits up to ``limit`` seconds for every pid to be gone; returns those still alive."""
    end = time.monotonic() + limit
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < end:
        time.sleep(0.02)
        left = [p for p in left if alive(p)]
    return left


def _snapshot() -> Dict[str, Set[str]]:
    from tether import _zygote

    gc.collect()
    zygotes = set(_zygote.pids())
    return {
        "children": {str(p) for p in child_pids() - zygotes},
        "fds": set(os.listdir("/proc/self/fd")),
        "tmp": set(os.listdir(tempfile.gettempdir())),
        "shm": set(os.listdir("/dev/shm")),
    }


@pytest.fixture(scope="session", autouse=True)
def _long_lived_helpers() -> None:
    """Starts what lives for the whole session (the resource tracker, the supervisor thread)
    so that the per-test check sees only what a test itself left."""
    from multiprocessing import resource_tracker

    import tether

    resource_tracker.ensure_running()
    tether.start_processes(_noop, nprocs=1, start_method="spawn")
    # The default zygote lives as long as the process that uses it.
    tether.start_processes(_noop, nprocs=1, start_method="forkserver")
    # multiprocessing keeps the shared-memory arena of its first Value for reuse.
    _kept.append(multiprocessing.get_context("spawn").Value("i", 0))


_kept: List[object] = []


def _noop(i: int) -> None:
    pass


@pytest.fixture(scope="session", autouse=True)
def _private_tmp() -> Iterator[None]:
    yield
    import shutil

    shutil.rmtree(_PRIVATE_TMP, ignore_errors=True)


@pytest.fixture(autouse=True)
def leaves_nothing_behind() -> Iterator[None]:
    before = _snapshot()
    yield
    deadline = time.monotonic() + 5
    while True:
        after = _snapshot()
        leaked = {k: after[k] - before[k] for k in after}
        # Another test's temp files (pytest's own) are not ours to judge.
        leaked["tmp"] = {n for n in leaked["tmp"] if not n.startswith("pytest-")}
        if not any(leaked.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for fd in leaked["fds"]:
        try:
            leaked["fds"] = leaked["fds"] - {fd} | {f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}"}
        except OSError:
            pass
    assert not any(leaked.values()), f"left behind: {leaked}"
