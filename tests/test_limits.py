"""Limits are tether's problem first: under a lowered RLIMIT_NPROC, a start that the limit
cannot hold fails with an error that names the limit and what tether's idle processes held,
leaves nothing of tether holding the limit, and the blanks the zygote keeps ready never take
more than half of what the limit leaves. Run as an unprivileged user (the limit does not
bind root: the tests, run as root, make that user)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPTS = Path(__file__).parent / "scripts"
LIMIT = 30


def run_as(uid: int, tmp_path: Path, script: str, *args: str) -> Dict[str, Any]:
    """Runs ``scripts/SCRIPT UID ARGS`` (it drops to ``uid``, which owns ``tmp_path``, its
    working and temporary directory); returns what it printed last, as JSON."""
    os.chown(tmp_path, uid, uid)
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / script), str(uid), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
        env=dict(os.environ, TMPDIR=str(tmp_path)),
    )
    assert proc.returncode == 0, proc.stderr
    result: Dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return result


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_start_past_rlimit_nproc_names_it_and_leaves_nothing_holding_it(
    method: str, tmp_path: Path
) -> None:
    uid = 61000 + os.getpid() % 4000
    out = run_as(uid, tmp_path, "under_nproc.py", str(LIMIT), method)
    error = out["error"]
    assert error is not None and error.startswith("BlockingIOError"), out
    assert "RLIMIT_NPROC = 30" in error and "`ulimit -u`" in error, error
    if method == "forkserver":
        assert "tether's idle processes held" in error, error
    # The interpreter (and its threads) and the zygote: no blank holds a process.
    assert out["tasks_after"] <= 5, out
    assert (out["subprocess"], out["pool"]) == (0, 49), out
    # The zygote would keep 20 blanks after a start of 20: half of what the limit leaves.
    assert out["blanks"] <= out["room_for_blanks"] // 2, out
    if method == "forkserver":
        assert out["blanks"] >= 1, out


@pytest.mark.parametrize("limit", ["nproc", "nofile"])
def test_tether_run_past_the_process_or_fd_limit_names_ulimit(limit: str, tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text("print('ran')\n")
    run = [str(Path(sys.executable).with_name("tether")), "run", "-n", "4", str(script)]
    if limit == "nproc":
        uid = 61000 + os.getpid() % 4000
        os.chown(tmp_path, uid, uid)
        command = [sys.executable, str(SCRIPTS / "as_user.py"), str(uid), "8", *run]
        named = "(RLIMIT_NPROC = 8, `ulimit -u`)"
    else:
        command = ["sh", "-c", 'ulimit -n 12 && exec "$@"', "sh", *run]
        named = "(RLIMIT_NOFILE = 12, `ulimit -n`)"
    proc = subprocess.run(
        command,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=dict(os.environ, TMPDIR=str(tmp_path)),
    )
    assert proc.returncode != 0, proc
    assert named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_idle_blanks_give_way_to_a_process_limit_lowered_after_a_40_rank_start(
    tmp_path: Path,
) -> None:
    # A uid of this test alone: every task of it is the script's, counted at the moment.
    uid = 61000 + (os.getpid() + 1) % 4000
    margin = 8
    out = run_as(uid, tmp_path, "lowered_nproc.py", str(margin))
    # The 40-rank start left more blanks than the margin: kept, they would take it all.
    assert out["blanks_before"] >= 2 * margin, out
    # Lowering the limit gave them back before it took effect, down to half of the room.
    assert out["blanks_after"] <= margin // 2, out
    assert (out["thread"], out["subprocess"]) == ("started", "exit 0"), out
    # A start that needs more than the room the blanks left took theirs too.
    assert out["spawn"] == "ran", out
