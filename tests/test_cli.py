"""``tether run`` with real torch programs: the error file of ``@record`` in the report, and
a two-node gloo job on one machine (two launchers, static membership)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent


def tether_binary() -> Path:
    """``$TETHER_BIN``, else the binary bundled in the package, else the release build."""
    candidates = [
        os.environ.get("TETHER_BIN"),
        ROOT / "python" / "tether" / "bin" / "tether",
        ROOT / "target" / "release" / "tether",
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    pytest.fail(
        "no tether binary: set TETHER_BIN, or run `cargo build --release -p tether-cli`"
        " (looked at python/tether/bin/tether and target/release/tether)"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


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
        [
            str(tether_binary()),
            "run",
            "-n",
            "2",
            "--grace-period",
            "5",
            "--",
            sys.executable,
            str(script),
        ],
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


def test_two_nodes_on_one_machine_all_reduce(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "allreduce.py",
        """
        import os
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.tensor([float(os.environ["RANK"]) + 1.0])
        dist.all_reduce(t)
        print(f"sum={t.item():g} world={dist.get_world_size()}", flush=True)
        assert t.item() == 1 + 2 + 3 + 4, t
        dist.destroy_process_group()
        """,
    )
    port = str(free_port())
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    launchers = [
        subprocess.Popen(
            [
                str(tether_binary()),
                "run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "-n",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                "--grace-period",
                "5",
                "--",
                sys.executable,
                str(script),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for node in (0, 1)
    ]
    results = []
    try:
        for launcher in launchers:
            out, err = launcher.communicate(timeout=100)
            results.append((launcher.returncode, out, err))
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
                launcher.communicate()
    for node, (code, out, err) in enumerate(results):
        assert code == 0, f"node {node}: {err}"
        for local in range(2):
            rank = node * 2 + local
            assert f"[rank {rank}]: sum=10 world=4" in out, out


def test_console_script_execs_the_binary() -> None:
    env = dict(os.environ, TETHER_BIN=str(tether_binary()))
    code = "import sys, tether._cli; assert 'torch' not in sys.modules; tether._cli.main()"
    proc = subprocess.run(
        [sys.executable, "-c", code, "--version"],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("tether "), proc.stdout
