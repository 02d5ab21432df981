"""The ``tether`` command line from Python: the console script and ``python -m tether`` run
the launcher compiled into the extension, Python subcommands dispatch first, and ``tether
run`` reports a failing torch program through the error file of ``@record``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import List

import pytest

pytestmark = pytest.mark.timeout(120)


def tether(*args: str) -> List[str]:
    """The console script that installing tether put beside this interpreter."""
    return [str(Path(sys.executable).with_name("tether")), *args]


def python_m_tether(*args: str) -> List[str]:
    return [sys.executable, "-m", "tether", *args]


def write_script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


@pytest.mark.parametrize("entry", [tether, python_m_tether])
def test_console_script_and_python_dash_m_run_the_launcher(entry, tmp_path: Path) -> None:
    version = subprocess.run(
        entry("--version"), check=False, capture_output=True, text=True, timeout=30
    )
    assert (version.returncode, version.stdout.strip()) == (0, "tether 0.1.0"), version
    script = write_script(
        tmp_path,
        "where.py",
        """
        import os, sys
        print(os.environ["RANK"], sys.executable, "torch" in sys.modules)
        """,
    )
    proc = subprocess.run(
        entry("run", "-n", "2", str(script)),
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    lines = sorted(proc.stdout.splitlines())
    assert lines == [f"[rank {r}]: {r} {sys.executable} False" for r in range(2)], proc.stdout


def test_importing_the_command_line_does_not_import_torch() -> None:
    code = "import sys, tether.run.cli, tether.__main__; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_python_subcommands_dispatch_before_the_launcher_and_are_listed() -> None:
    code = textwrap.dedent(
        """
        import sys
        from tether.run import cli
        cli.COMMANDS["hello"] = cli.Command("Say hello", lambda a: print("hello", *a) or 3)
        cli.main(sys.argv[1:])
        """
    )
    hello = subprocess.run(
        [sys.executable, "-c", code, "hello", "--to", "you"],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (hello.returncode, hello.stdout) == (3, "hello --to you\n"), hello
    listed = subprocess.run(
        [sys.executable, "-c", code, "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert listed.returncode == 0, listed.stderr
    assert re.search(r"\n  hello +Say hello\n", listed.stdout), listed.stdout
    assert "run " in listed.stdout, listed.stdout


def test_record_error_file_is_the_report(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "fails.py",
        """
        import os
        from torch.distributed.elastic.multiprocessing.errors import record

        def check(rank: int) -> None:
            if rank == 1:
                raise ValueError(f"rank {rank} does not like its data")

        @record
        def main() -> None:
            check(int(os.environ["RANK"]))

        main()
        """,
    )
    proc = subprocess.run(
        tether("run", "-n", "2", "--grace-period", "5", str(script)),
        check=False,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 1, proc.stderr
    report = proc.stderr[proc.stderr.index("root cause") :]
    assert "rank 1 failed first" in proc.stderr
    assert "ValueError: rank 1 does not like its data" in report
    assert "traceback (from TORCHELASTIC_ERROR_FILE)" in report
    assert "Traceback (most recent call last)" in report
    assert "in check" in report
    # torch writes Unix seconds; the report shows local ISO-8601 with milliseconds.
    stamp = next(line for line in report.splitlines() if "timestamp  :" in line)
    assert stamp.split(" : ")[1][10] == "T" and "." in stamp, stamp


def test_a_script_that_is_missing_is_a_usage_error_not_a_rank_failure(tmp_path: Path) -> None:
    proc = subprocess.run(
        tether("run", "-n", "2", "python", str(tmp_path / "x.py")),
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ, PYTHON_EXEC=sys.executable),
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc
    assert "--no-python" in proc.stderr and sys.executable in proc.stderr, proc.stderr


def _marked(mark: str) -> List[int]:
    """Live processes whose environment carries ``TETHER_TEST_MARK=mark``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"TETHER_TEST_MARK={mark}".encode() in env and state != "Z":
            found.append(int(entry))
    return found


def test_sigkill_of_the_console_script_leaves_no_descendant(tmp_path: Path) -> None:
    mark = f"console-{os.getpid()}"
    leaver = (
        'setsid sleep 600 & sh -c "(setsid sleep 601 &); exit 0" & sleep 602 & '
        'sleep 0.1; echo > "$DIR/ready.$RANK"; wait'
    )
    launcher = subprocess.Popen(
        tether("run", "-n", "2", "--no-python", "sh", "-c", leaver),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=dict(os.environ, TETHER_TEST_MARK=mark, DIR=str(tmp_path)),
    )
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"ready.{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.02)
        assert len(_marked(mark)) >= 10, _marked(mark)
    finally:
        launcher.kill()
        _, err = launcher.communicate(timeout=30)
    deadline = time.monotonic() + 1
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _marked(mark) == [], err


def test_the_launcher_leaves_the_host_processs_own_children_alone() -> None:
    code = textwrap.dedent(
        """
        import subprocess
        from tether.run import cli
        own = subprocess.Popen(["sleep", "30"])
        status = cli.run_native(["run", "-n", "2", "--no-python", "sh", "-c", "sleep 0.1 &"])
        assert status == 0, status
        assert own.poll() is None, "the host's own child was killed or reaped"
        own.kill()
        assert own.wait() == -9
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert (proc.returncode, proc.stdout) == (0, "ok\n"), proc.stderr


@pytest.mark.parametrize("closed", ["0", "1", "2", "0 1 2"])
@pytest.mark.parametrize("entry", [tether, python_m_tether])
def test_tether_run_runs_with_any_standard_stream_closed(
    entry, closed: str, tmp_path: Path
) -> None:
    script = write_script(
        tmp_path,
        "rank.py",
        """
        import os, sys
        open(os.path.join(sys.argv[1], "ran." + os.environ["RANK"]), "w").close()
        print("done")
        """,
    )
    command = " ".join(f"'{a}'" for a in entry("run", "-n", "2", str(script), str(tmp_path)))
    closing = " ".join(f"{fd}>&-" if fd != "0" else "0<&-" for fd in closed.split())
    proc = subprocess.run(
        ["sh", "-c", f"{command} {closing}"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.glob("ran.*")) == ["ran.0", "ran.1"]
    if "1" not in closed:
        assert sorted(proc.stdout.splitlines()) == ["[rank 0]: done", "[rank 1]: done"]


def test_tether_run_with_stderr_closed_reports_a_failure_on_stdout(tmp_path: Path) -> None:
    script = write_script(tmp_path, "fail.py", "raise SystemExit(3)\n")
    command = " ".join(f"'{a}'" for a in tether("run", "-n", "1", str(script)))
    proc = subprocess.run(
        ["sh", "-c", f"{command} 2>&-"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3
    assert "exit code 3" in proc.stdout, proc.stdout


def test_no_process_an_attempt_left_is_alive_or_unreaped_when_the_next_attempt_starts(
    tmp_path: Path,
) -> None:
    restarts = 4
    mark = f"attempts-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.run(
        tether(
            "run",
            "-n",
            "2",
            "--max-restarts",
            str(restarts),
            str(Path(__file__).parent / "scripts" / "leaves_daemons.py"),
            str(tmp_path),
            mark,
        ),
        check=False,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("restarting all 2 ranks") == restarts, proc.stderr
    for attempt in range(restarts + 1):
        for rank in range(2):
            pids = json.loads((tmp_path / f"pids.{attempt}.{rank}").read_text())
            assert len(pids) == 4, pids
            seen = json.loads((tmp_path / f"seen.{attempt}.{rank}").read_text())
            assert seen == [], f"attempt {attempt}, rank {rank} met {seen}"


@pytest.mark.parametrize("tmpdir", ["missing", "a file", "unwritable"])
def test_tether_run_falls_back_as_tempfile_does_when_tmpdir_is_unusable(
    tmpdir: str, tmp_path: Path
) -> None:
    where = {
        "missing": tmp_path / "gone" / "tmp",
        "a file": tmp_path / "file",
        # Not even root creates a file in /proc.
        "unwritable": Path("/proc"),
    }[tmpdir]
    (tmp_path / "file").write_text("")
    script = write_script(
        tmp_path,
        "rank.py",
        """
        import os, sys, tempfile
        print(os.environ["RANK"], tempfile.gettempdir() != os.environ["TMPDIR"])
        """,
    )
    proc = subprocess.run(
        tether("run", "-n", "2", str(script)),
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, TMPDIR=str(where)),
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[rank 0]: 0 True", "[rank 1]: 1 True"]


def test_tether_stacks_of_another_users_launcher_says_so_without_a_traceback(
    tmp_path: Path,
) -> None:
    script = write_script(
        tmp_path,
        "rank.py",
        """
        import os, sys, time
        open(os.path.join(sys.argv[1], "ready"), "w").close()
        time.sleep(60)
        """,
    )
    launcher = subprocess.Popen(
        tether("run", "-n", "1", str(script), str(tmp_path)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.02)
        uid = 61000 + os.getpid() % 4000
        scripts = Path(__file__).parent / "scripts"
        asked = subprocess.run(
            [sys.executable, str(scripts / "as_user.py"), str(uid), "1000"]
            + tether("stacks", str(launcher.pid)),
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        launcher.terminate()
        launcher.communicate(timeout=30)
    assert asked.returncode == 1, asked
    assert asked.stderr == (
        f"tether stacks: pid {launcher.pid} belongs to another user: ask as that user "
        "(or as root)\n"
    ), asked.stderr
