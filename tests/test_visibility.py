"""Seeing into the runtime: every process tether starts says what it is in ``ps`` and
``/proc/PID/comm``; ``tether.status()`` and ``python -m tether ps`` list what runs;
``TETHER_LOG`` turns on one line per event, and nothing is printed without it."""

from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import tether
from conftest import cmdline
from tether.zygote import client

pytestmark = pytest.mark.timeout(120)


def comm(pid):
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def wait_for_release(i, ready, release):
    ready.put(os.getpid())
    release.wait(30)


@pytest.fixture
def running():
    """Starts two ranks that wait; yields their context; lets them finish."""
    mp = multiprocessing.get_context("spawn")
    made = []

    def start(method):
        ready, release = mp.SimpleQueue(), mp.Event()
        ctx = tether.start_processes(
            wait_for_release, args=(ready, release), nprocs=2, join=False, start_method=method
        )
        made.append((ctx, release))
        [ready.get() for _ in range(2)]
        return ctx

    yield start
    for ctx, release in made:
        release.set()
        ctx.join(30)
    made.clear()  # pytest keeps `start` (and so this list) until the test is over


def test_ranks_say_their_rank_and_function(running, start_method):
    ctx = running(start_method)
    for rank, pid in enumerate(ctx.pids()):
        assert cmdline(pid) == (
            f"tether rank {rank}: wait_for_release [{start_method}, parent {os.getpid()}]"
        )
        assert comm(pid) == f"tether:r{rank}:wait_for_release"[:15]


def nap(i, seconds):
    time.sleep(seconds)


def test_a_spawn_rank_is_named_while_its_interpreter_starts():
    ctx = tether.start_processes(nap, args=(1.0,), nprocs=1, join=False, start_method="spawn")
    try:
        (pid,) = ctx.pids()
        # Renamed by the child once it runs, or still the interpreter's command line, which
        # carries the name too.
        assert f"tether rank 0: nap [spawn, parent {os.getpid()}]" in cmdline(pid)
    finally:
        ctx.join()


def test_the_zygote_and_its_blanks_say_what_they_are(running):
    running("forkserver")
    zygote = client.get()
    deadline = time.monotonic() + 10
    while len(zygote.pids()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # the zygote forks children ahead once it is idle
    pids = zygote.pids()
    assert len(pids) >= 2, "the zygote keeps children ready"
    assert cmdline(pids[0]).startswith(f"tether zygote of pid {os.getpid()} (preload: ")
    assert comm(pids[0]) == "tether-zygote"
    for blank in pids[1:]:
        assert cmdline(blank).startswith(f"tether blank of zygote {pids[0]} ")
        assert comm(blank) == "tether-blank"


def test_status_lists_zygotes_and_groups(running):
    ctx = running("forkserver")
    found = tether.status()
    assert found.pid == os.getpid()
    zygote = client.get()
    assert any(z.pid == zygote.pid and z.blanks == zygote.pids()[1:] for z in found.zygotes)
    group = next(g for g in found.groups if [r.pid for r in g.ranks] == ctx.pids())
    assert group.what == "wait_for_release" and group.start_method == "forkserver"
    assert [r.state for r in group.ranks] == ["running", "running"]
    text = str(found)
    assert f"zygote {zygote.pid}" in text and "wait_for_release [forkserver]" in text


def test_ps_shows_the_tree_from_the_names(running):
    ctx = running("forkserver")
    done = subprocess.run(
        [sys.executable, "-m", "tether", "ps"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    # Other tether processes of this user, if any, show as trees of their own, each after
    # a blank line.
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert lines[0].split() == ["PID", "WHAT"]
    me = next(n for n, line in enumerate(lines) if line.split()[0] == str(os.getpid()))
    below = "\n".join(lines[me + 1 :])
    for pid in ctx.pids():
        assert f"{pid}  ├─ tether rank" in below or f"{pid}  └─ tether rank" in below
    assert "tether zygote of pid" in below


RANK_THAT_WAITS = textwrap.dedent(
    """
    import os, sys, time
    ready = os.path.join(sys.argv[1], "ready." + os.environ["RANK"])
    with open(ready + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(ready + ".tmp", ready)
    release = os.path.join(sys.argv[1], "release")
    deadline = time.monotonic() + 60
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.02)
    """
)


def test_ps_shows_a_tether_run_job_whole_and_never_itself(tmp_path):
    script = tmp_path / "waits.py"
    script.write_text(RANK_THAT_WAITS)
    launcher = [str(Path(sys.executable).with_name("tether")), "run", "-n", "2"]
    job = subprocess.Popen(
        [*launcher, "--rdzv-id", "psjob", str(script), str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        ready = [tmp_path / f"ready.{r}" for r in range(2)]
        while not all(r.exists() for r in ready) and time.monotonic() < deadline:
            time.sleep(0.02)
        ranks = [int(r.read_text()) for r in ready]
        ps = subprocess.Popen(
            [str(Path(sys.executable).with_name("tether")), "ps"],
            stdout=subprocess.PIPE,
            text=True,
        )
        out, _ = ps.communicate(timeout=60)
        assert ps.returncode == 0
        lines = [line for line in out.splitlines() if line.strip()]
        assert not any(line.split()[0] == str(ps.pid) for line in lines[1:]), out
        at = {int(line.split()[0]): n for n, line in enumerate(lines[1:], 1)}
        keeper = job.pid
        supervisor = int(open(f"/proc/{ranks[0]}/stat").read().rsplit(")", 1)[1].split()[1])
        assert comm(supervisor) == "tether-supervis"
        assert cmdline(supervisor) == f"tether supervisor of run psjob (keeper {keeper}, 2 rank(s))"
        assert "tether run keeper: " in lines[at[keeper]] and "--rdzv-id psjob" in out
        assert f"└─ tether supervisor of run psjob (keeper {keeper}" in lines[at[supervisor]]
        for rank, pid in enumerate(ranks):
            line = lines[at[pid]]
            assert f"rank {rank} (local {rank}): " in line and str(script) in line, out
        # The tree: keeper, then its supervisor, then the ranks under it.
        assert at[keeper] < at[supervisor] < min(at[p] for p in ranks)
    finally:
        (tmp_path / "release").write_text("")
        _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err


LOGGED = textwrap.dedent(
    """
    import signal, time, tether

    def stubborn(i):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if i == 0:
            raise SystemExit(3)
        time.sleep(30)

    if __name__ == "__main__":
        try:
            ctx = tether.start_processes(stubborn, nprocs=2, join=False)
            time.sleep(0.5)
            ctx.join(grace_period=0.2)
        except tether.ProcessExitedException:
            pass
    """
)


def run_logged(tmp_path, level):
    script = tmp_path / "logged.py"
    script.write_text(LOGGED)
    env = dict(os.environ)
    env.pop("TETHER_LOG", None)
    if level:
        env["TETHER_LOG"] = level
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [line for line in done.stderr.splitlines() if line.startswith("tether[")]


def test_tether_log_shows_one_line_per_event(tmp_path):
    lines = "\n".join(run_logged(tmp_path, "debug"))
    for event in (
        "INFO tether: started the zygote",
        "INFO tether::zygote: zygote pid",
        "INFO tether::warden: adopted pid",
        "INFO tether::warden: pid",  # an exit, with its status
        "exit code 3",
        "sent SIGTERM to pids",
        "WARN tether::warden: escalated to SIGKILL",
        "DEBUG tether: started 2 process(es) of stubborn",
    ):
        assert event in lines, f"{event!r} not in:\n{lines}"


def test_nothing_is_logged_by_default(tmp_path):
    assert run_logged(tmp_path, None) == []
    assert run_logged(tmp_path, "off") == []


def test_the_zygotes_log_line_names_a_few_preloaded_modules_and_their_count():
    # A process that imported many modules: the zygote preloads every one of them.
    code = (
        "import asyncio, decimal, email.mime.text, http.server, json, xml.etree.ElementTree\n"
        "import sys, tether\n"
        "tether.spawn(abs, nprocs=1)\n"
    )
    env = dict(os.environ, TETHER_LOG="info")
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "started the zygote (pid" in line]
    words = re.search(r"preloading (\d+) modules \((.*)\)$", line)
    assert words is not None, line
    count, names = int(words[1]), words[2].split(", ")
    assert count > 50 and len(line) < 200, line
    assert len(names) == 7 and names[-1] == f"+{count - 6} more", line
    assert "asyncio" in names or "json" in names, line


def test_the_launcher_logs_its_events(tmp_path):
    env = dict(os.environ, TETHER_LOG="info")
    done = subprocess.run(
        [sys.executable, "-m", "tether", "run", "-n", "2", "--no-python", "sh", "-c", "exit 3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 3
    lines = "\n".join(line for line in done.stderr.splitlines() if line.startswith("tether["))
    assert "INFO tether::run: attempt 0: started 2 rank(s)" in lines, done.stderr
    assert "INFO tether::warden: pid" in lines and "exit code 3" in lines


def test_info_leaves_out_debug_events(tmp_path):
    lines = run_logged(tmp_path, "info")
    assert lines and not any(" DEBUG " in line for line in lines)


def test_pool_workers_say_their_pool_and_slot():
    with tether.Pool(2) as pool:
        number = tether.status().pools[-1].pool_id
        for pid in pool.pids():
            args = cmdline(pid)
            assert args.startswith(f"tether pool {number} worker "), args
            slot = int(args.split()[4])
            assert comm(pid) == f"tether:p{number}w{slot}"
        found = next(p for p in tether.status().pools if p.pool_id == number)
        assert sorted(w.pid for w in found.workers) == sorted(pool.pids())
        assert {w.state for w in found.workers} == {"ready"}


POOL_LOGGED = textwrap.dedent(
    """
    import os, signal, time, tether

    if __name__ == "__main__":
        with tether.Pool(1) as pool:
            (pid,) = pool.pids()
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while pool.pids() in ([pid], []) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pool.submit(abs, -3).result() == 3
    """
)


def test_the_pool_logs_a_death_and_its_replacement(tmp_path):
    script = tmp_path / "pool_logged.py"
    script.write_text(POOL_LOGGED)
    env = dict(os.environ, TETHER_LOG="info")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=90
    )
    assert done.returncode == 0, done.stderr
    lines = "\n".join(line for line in done.stderr.splitlines() if line.startswith("tether["))
    assert "INFO tether: pool 1: worker 0 (pid" in lines and "died with signal SIGKILL" in lines
    assert "INFO tether: pool 1: worker 0 replaced" in lines, lines


def test_ps_keeps_a_multi_line_command_on_one_line(tmp_path):
    ready = tmp_path / "ready"
    program = f"import pathlib, time\npathlib.Path({str(ready)!r}).touch()\ntime.sleep(30)"
    tether_cmd = str(Path(sys.executable).with_name("tether"))
    job = subprocess.Popen(
        [tether_cmd, "run", "-n", "1", "--no-python", sys.executable, "-c", program],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        out = subprocess.run([tether_cmd, "ps"], capture_output=True, text=True, timeout=60)
        lines = out.stdout.splitlines()
        assert all(line.split()[0] == "PID" or line.split()[0].isdigit() for line in lines), out
        assert any("import pathlib, time\\npathlib.Path(" in line for line in lines), out.stdout
    finally:
        job.kill()
        job.wait(timeout=30)


@pytest.mark.parametrize("how", ["console script", "python -m tether"])
def test_ps_never_lists_itself(how):
    command = {
        "console script": [str(Path(sys.executable).with_name("tether")), "ps"],
        "python -m tether": [sys.executable, "-m", "tether", "ps"],
    }[how]
    done = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    out, _ = done.communicate(timeout=60)
    assert done.returncode == 0
    listed = [line.split()[0] for line in out.splitlines()[1:] if line.strip()]
    assert str(done.pid) not in listed, out


STARTS = textwrap.dedent(
    """
    import sys, tether

    def quick(i):
        import tether  # a child that imports tether leaves the warning to its parent

    if __name__ == "__main__":
        tether.start_processes(quick, nprocs=2, start_method=sys.argv[1])
    """
)


@pytest.mark.parametrize("value", ["loud", "Warning"])
def test_an_invalid_tether_log_is_one_warning_and_nothing_logged(tmp_path, start_method, value):
    script = tmp_path / "starts.py"
    script.write_text(STARTS)
    done = subprocess.run(
        [sys.executable, str(script), start_method],
        capture_output=True,
        text=True,
        env=dict(os.environ, TETHER_LOG=value),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    warning = (
        f"RuntimeWarning: TETHER_LOG={value!r} is not a log level (off, error, warn, info, "
        "debug, trace): nothing is logged"
    )
    assert done.stderr.count(warning) == (1 if value == "loud" else 0), done.stderr
    if value == "loud":
        assert "tether[" not in done.stderr, done.stderr


def test_tether_run_warns_once_of_an_invalid_tether_log(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text("print('ran')\n")
    done = subprocess.run(
        [str(Path(sys.executable).with_name("tether")), "run", "-n", "2", str(script)],
        capture_output=True,
        text=True,
        env=dict(os.environ, TETHER_LOG="loud"),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("TETHER_LOG='loud' is not a log level") == 1, done.stderr
