"""The zygote behind start_method="forkserver": children as fresh as spawn's, preloading,
restarts, and safety against a busy, multi-threaded parent."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

import tether
from conftest import stray_children, wait_gone
from tether.zygote import client

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).resolve().parent


@pytest.fixture
def own_zygote():
    """A zygote with its own preload set, stopped at the end of the test."""
    made = []

    def make(preload=("json",)):
        made.append(client.get(preload))
        return list(preload)

    yield make
    for zygote in made:
        zygote.close()


def report_randoms(i, queue):
    import numpy

    queue.put((random.random(), float(numpy.random.random())))


def report_stack(i, queue):
    import traceback

    queue.put([(Path(f.filename).name, f.name) for f in traceback.extract_stack()])


def report_torch_random(i, queue):
    import torch

    queue.put((torch.initial_seed(), torch.rand(3).tolist()))


def report_state(i, queue):
    queue.put(
        (
            os.environ.get("TETHER_TEST_VALUE"),
            os.getcwd(),
            os.getppid(),
            os.getpgrp() == os.getpid(),
        )
    )


def kill_zygote_then_sleep(i, zygote_pid):
    if i == 0:
        os.kill(zygote_pid, signal.SIGKILL)
    time.sleep(0.5)


def success(i):
    pass


@pytest.mark.parametrize("preload", [None, ("numpy", "numpy.random")])
def test_children_have_their_own_random_streams(own_zygote, preload):
    import numpy  # noqa: F401  (so that the default zygote preloads numpy)

    if preload is not None:
        own_zygote(preload)  # numpy's global generator already loaded in the zygote
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    tether.start_processes(
        report_randoms, args=(queue,), nprocs=3, start_method="forkserver", preload=preload
    )
    draws = [queue.get() for _ in range(3)]
    assert len({d[0] for d in draws}) == 3, "Python's random repeats across children"
    assert len({d[1] for d in draws}) == 3, "numpy's global generator repeats across children"


def test_torch_generator_starts_as_in_a_spawned_child():
    pytest.importorskip("torch")
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    tether.start_processes(report_torch_random, args=(queue,), nprocs=2, start_method="spawn")
    spawned = [queue.get() for _ in range(2)]
    tether.start_processes(report_torch_random, args=(queue,), nprocs=2, start_method="forkserver")
    forked = [queue.get() for _ in range(2)]
    if spawned[0] == spawned[1]:
        # A torch build with a fixed default seed: every new process starts the same way.
        assert forked == spawned
    else:
        # A torch build that seeds at random: every child draws its own seed.
        assert forked[0] != forked[1]


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_childs_function_runs_right_under_tethers_start(method):
    # What a child's stack holds of tether is what every stack it formats walks (torch's
    # DataLoader workers format it three times as they seed): two frames and the entry.
    # (A fork child's stack is its parent's, as with multiprocessing.)
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    tether.start_processes(report_stack, args=(queue,), nprocs=1, start_method=method)
    stack = queue.get()
    queue.close()
    assert stack[-1] == ("test_zygote.py", "report_stack")
    assert len(stack) <= 4, stack


def test_children_see_the_parents_current_environment_and_directory(tmp_path, monkeypatch):
    tether.warm_up()
    monkeypatch.setenv("TETHER_TEST_VALUE", "set after the zygote started")
    monkeypatch.chdir(tmp_path)
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    tether.start_processes(report_state, args=(queue,), nprocs=1, start_method="forkserver")
    value, cwd, ppid, leads_group = queue.get()
    assert value == "set after the zygote started"
    assert cwd == str(tmp_path)
    assert ppid == os.getpid(), "the child is not a child of the spawning process"
    assert leads_group


def report_environment(i, queue):
    queue.put(dict(os.environ))


def test_children_get_the_callers_environment_exactly(own_zygote, monkeypatch):
    monkeypatch.setenv("TETHER_TEST_GONE", "in the zygote's environment only")
    monkeypatch.setenv("TETHER_TEST_CHANGED", "before")
    preload = own_zygote(("json",))
    tether.start_processes(success, nprocs=1, preload=preload)  # the zygote is up
    monkeypatch.delenv("TETHER_TEST_GONE")
    monkeypatch.setenv("TETHER_TEST_CHANGED", "after")
    monkeypatch.setenv("TETHER_TEST_NEW", "new")
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    tether.start_processes(report_environment, args=(queue,), nprocs=1, start_method="spawn")
    spawned = queue.get()
    assert spawned["TETHER_TEST_CHANGED"] == "after" and "TETHER_TEST_GONE" not in spawned
    tether.start_processes(report_environment, args=(queue,), nprocs=2, preload=preload)
    assert [queue.get(), queue.get()] == [spawned, spawned]


def test_a_module_that_fails_to_preload_is_a_warning(own_zygote):
    preload = own_zygote(("json", "tether_no_such_module"))
    with pytest.warns(RuntimeWarning, match="cannot preload module 'tether_no_such_module'"):
        tether.start_processes(success, nprocs=2, start_method="forkserver", preload=preload)


THREADED_PACKAGE = """
import threading
import time

lock = threading.Lock()
held = threading.Event()


def _hold():
    # An agent's thread: it holds its lock while it works, nearly all the time.
    while True:
        with lock:
            held.set()
            time.sleep(0.05)
        time.sleep(0.001)


threading.Thread(target=_hold, daemon=True, name="agent").start()
held.wait(10)


def use():
    # What a call into the package does: take the agent's lock (for a moment).
    if not lock.acquire(timeout=10):
        raise RuntimeError("the agent's lock is held for ever")
    lock.release()
"""


def use_threaded_package(i):
    import tether_threaded_agent

    tether_threaded_agent.use()


def test_a_preloaded_module_that_starts_a_thread_is_left_out_and_children_do_not_hang(
    own_zygote, tmp_path, monkeypatch
):
    (tmp_path / "tether_threaded_agent").mkdir()
    (tmp_path / "tether_threaded_agent" / "__init__.py").write_text(THREADED_PACKAGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    preload = own_zygote(("json", "tether_threaded_agent", "csv"))
    with pytest.warns(RuntimeWarning) as caught:
        tether.start_processes(
            use_threaded_package, nprocs=2, start_method="forkserver", preload=preload
        )
    said = [str(w.message) for w in caught]
    assert any(
        "left 'tether_threaded_agent' out of the preload: importing it started a thread" in s
        for s in said
    ), said
    assert not any("forking such a process is unsafe" in s for s in said), said
    # The zygote is single-threaded again, and has the rest of its preload.
    zygote = client.get(preload)
    assert len(os.listdir(f"/proc/{zygote.pid}/task")) == 1
    # Later starts reuse it without another warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tether.start_processes(
            use_threaded_package, nprocs=2, start_method="forkserver", preload=preload
        )


def test_set_preload_chooses_the_zygote(own_zygote):
    preload = own_zygote(("json", "csv"))
    tether.set_preload(preload)
    try:
        tether.start_processes(success, nprocs=1)
        assert client.get().preload == ("json", "csv")
    finally:
        tether.set_preload(None)


def test_a_killed_zygote_is_restarted_with_a_warning(own_zygote):
    preload = own_zygote()
    tether.start_processes(success, nprocs=1, preload=preload)
    zygote = client.get(preload)
    old = zygote.pid
    os.kill(old, signal.SIGKILL)
    assert wait_gone([old], 5.0) == []
    with pytest.warns(RuntimeWarning, match=rf"zygote \(pid {old}\) died with signal SIGKILL"):
        tether.start_processes(success, nprocs=2, preload=preload)
    assert zygote.pid != old


def test_a_zygote_dying_during_a_spawn_fails_clearly(own_zygote):
    preload = own_zygote()
    zygote = client.get(preload)
    tether.start_processes(success, nprocs=1, preload=preload)
    # The first child kills the zygote while it may still be forking the others: either the
    # call fails with a clear error, or (if every fork was done) the children run and the
    # next call restarts the zygote. It never hangs, and nothing is left running.
    try:
        tether.start_processes(
            kill_zygote_then_sleep, args=(zygote.pid,), nprocs=40, preload=preload
        )
    except RuntimeError as e:
        assert "zygote" in str(e) and "SIGKILL" in str(e)
    assert stray_children() == set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        tether.start_processes(success, nprocs=1, preload=preload)


def test_busy_parent_threads_holding_locks_do_not_deadlock_children():
    import logging

    stop = threading.Event()
    lock = threading.Lock()
    handler_lock = logging.getLogger().handlers[0].lock if logging.getLogger().handlers else None

    def busy():
        while not stop.is_set():
            with lock:
                data = [bytearray(4096) for _ in range(50)]  # malloc under a held lock
                if handler_lock is not None:
                    with handler_lock:
                        del data

    threads = [threading.Thread(target=busy) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for _ in range(5):
            tether.start_processes(success, nprocs=4, start_method="forkserver")
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_concurrent_spawns_from_several_threads():
    errors = []

    def run():
        try:
            for _ in range(3):
                tether.start_processes(success, nprocs=2, start_method="forkserver")
        except BaseException as e:  # noqa: BLE001 # pragma: no cover - asserted below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_child_output_goes_to_the_parents_current_stdout(capfd):
    tether.start_processes(print_hello, nprocs=1, start_method="forkserver")
    assert "hello from the zygote child" in capfd.readouterr().out


def print_hello(i):
    print("hello from the zygote child", flush=True)


def test_the_zygote_does_not_import_the_users_modules():
    # This test module was imported by the parent, but is not an installed package.
    assert "test_zygote" not in client.get().preload
    assert all(
        "/tests/" not in (getattr(sys.modules.get(m), "__file__", "") or "")
        for m in client.get().preload
    )


@pytest.mark.parametrize("kills", [1, 2])
def test_a_zygote_killed_while_it_imports_its_preload_is_replaced_once_then_a_zygote_error(
    own_zygote, kills, tmp_path, monkeypatch
):
    # A module that announces each zygote importing it, and holds the import while the
    # test kills that zygote.
    name = f"tether_test_slow_{os.getpid()}_{kills}"
    (tmp_path / f"{name}.py").write_text(
        "import os, time\n"
        "with open(os.environ['SLOW_PIDS'], 'a') as f:\n"
        "    f.write(f'{os.getpid()}\\n')\n"
        "deadline = time.monotonic() + 30\n"
        "while os.path.exists(os.environ['SLOW_HOLD']) and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
    )
    pids_file, hold = tmp_path / "pids", tmp_path / "hold"
    hold.touch()
    monkeypatch.setenv("SLOW_PIDS", str(pids_file))
    monkeypatch.setenv("SLOW_HOLD", str(hold))
    monkeypatch.syspath_prepend(str(tmp_path))
    preload = own_zygote(("json", name))
    killed = []

    def kill_each_zygote_as_it_imports():
        deadline = time.monotonic() + 60
        while len(killed) < kills and time.monotonic() < deadline:
            lines = pids_file.read_text().split() if pids_file.exists() else []
            if len(lines) > len(killed):
                killed.append(int(lines[len(killed)]))
                os.kill(killed[-1], signal.SIGKILL)
            time.sleep(0.005)
        hold.unlink()

    killer = threading.Thread(target=kill_each_zygote_as_it_imports)
    killer.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if kills == 1:
                tether.start_processes(success, nprocs=2, preload=preload)
            else:
                with pytest.raises(tether.ZygoteError) as raised:
                    tether.start_processes(success, nprocs=2, preload=preload)
    finally:
        killer.join()
    assert len(killed) == kills
    assert f"zygote (pid {killed[0]}) died with signal SIGKILL; starting a new one" in "\n".join(
        str(w.message) for w in caught
    )
    if kills == 2:
        message = str(raised.value)
        assert f"zygote (pid {killed[1]}) died with signal SIGKILL" in message, message
        assert "while importing" in message and name in message, message
    assert stray_children() == set()


NOISY = """
import os, sys, warnings
print("noisy: print at import")
sys.stderr.write("noisy: stderr at import\\n")
warnings.warn("noisy: a warning at import")
os.write(1, b"noisy: fd 1 at import\\n")
os.write(2, b"noisy: fd 2 at import\\n")
"""


def test_a_preloaded_package_that_prints_or_warns_at_import_stays_off_the_users_streams(
    own_zygote, capfd, tmp_path, monkeypatch
):
    name = f"tether_test_noisy_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text(NOISY)
    monkeypatch.syspath_prepend(str(tmp_path))
    preload = own_zygote(("json", name))
    capfd.readouterr()
    tether.start_processes(print_hello, nprocs=2, preload=preload)
    assert client.get(preload).pids()  # the zygote preloaded it and runs
    out, err = capfd.readouterr()
    assert "noisy" not in out + err, (out, err)
    assert out.count("hello from the zygote child") == 2, out


def test_children_find_the_modules_of_tether_their_parent_imported_in_the_zygote():
    # A child runs its parent's __main__ again; what that imports of tether beyond the
    # package (tether.pool, a private module) is the zygote's already, never imported anew.
    got = subprocess.run(
        [sys.executable, "-X", "importtime", str(HERE / "scripts" / "own_modules.py")],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    children = got.stderr.split("-- children start\n")[1].split("-- children done")[0]
    imported = [line.rsplit("|", 1)[-1].strip() for line in children.splitlines()]
    assert not [m for m in imported if m.startswith("tether")], children


def test_the_zygote_never_takes_tethers_command_line_entry_for_a_module_to_import(monkeypatch):
    # Importing tether.__main__ would run the command line in the zygote.
    monkeypatch.setitem(sys.modules, "tether.__main__", sys.modules["tether"])
    monkeypatch.setitem(sys.modules, "tether.not_a_module", None)
    own = client.own_modules()
    assert "tether.zygote.client" in own and "tether.spawn" in own
    assert "tether.__main__" not in own and "tether.not_a_module" not in own
    assert all(name.startswith("tether.") for name in own)
