"""``tether run`` is a drop-in for torchrun's command line: a DDP training script (CPU,
gloo) run with torchrun's exact command lines, as a script, a module and a plain command,
with a c10d or static rendezvous on one node, and with two launchers acting as two nodes."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

pytestmark = pytest.mark.timeout(240)

SCRIPTS = Path(__file__).resolve().parent / "scripts"
DDP = str(SCRIPTS / "ddp_train.py")
RESULT = re.compile(r"rank=(\d+) local_rank=(\d+) world=(\d+) epochs=(\d+) params=(-?\d+\.\d{6})")
ENV = dict(os.environ, GLOO_SOCKET_IFNAME="lo")


@pytest.fixture(autouse=True)
def _private_tmpdir(tmp_path: Path) -> None:
    """torch writes caches (torchinductor_<user>) to the temporary directory: give them the
    test's own."""
    ENV["TMPDIR"] = str(tmp_path)


def tether(*args: str) -> List[str]:
    return [str(Path(sys.executable).with_name("tether")), "run", *args]


#: What a gloo rank prints when it aborts inside torch's C++ (seen now and then on this
#: machine, under torchrun and tether alike): a fault of the peer library, not of a launcher.
GLOO_ABORT = "terminate called without an active exception"


def run(argv: List[str], cwd: Optional[Path] = None, **env: str) -> Tuple[int, str, str]:
    """Runs ``argv``; a run in which a rank aborted inside gloo is run again (three tries)."""
    for _ in range(3):
        proc = subprocess.run(
            argv,
            check=False,
            capture_output=True,
            text=True,
            timeout=200,
            cwd=cwd,
            env=dict(ENV, **env),
        )
        if proc.returncode == 0 or GLOO_ABORT not in proc.stdout + proc.stderr:
            break
    return proc.returncode, proc.stdout, proc.stderr


def results(stdout: str) -> Dict[int, Tuple[int, int, int, str]]:
    """rank -> (local rank, world size, epochs, parameter checksum), from the ranks' lines
    (torchrun's ranks share its stdout and can cut each other's lines)."""
    found = {}
    for match in RESULT.finditer(stdout):
        rank, local, world, epochs, params = match.groups()
        found[int(rank)] = (int(local), int(world), int(epochs), params)
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_script_form_gives_what_torchrun_gives(tmp_path: Path) -> None:
    args = ["--standalone", "--nproc_per_node=2", DDP, "--epochs", "3"]
    code, out, err = run(tether(*args))
    assert code == 0, err
    ours = results(out)
    assert sorted(ours) == [0, 1] and all(line.startswith("[rank ") for line in out.splitlines())
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    code, out, err = run([torchrun, *args])
    assert code == 0, err
    assert results(out) == ours


def test_the_module_form() -> None:
    argv = tether("--nproc-per-node", "2", "-m", "ddp_train", "--epochs", "2")
    code, out, err = run(argv, SCRIPTS)
    assert code == 0, err
    assert {r: v[:3] for r, v in results(out).items()} == {0: (0, 2, 2), 1: (1, 2, 2)}, out


def test_the_no_python_form() -> None:
    code, out, err = run(tether("--nproc_per_node=2", "--no_python", sys.executable, DDP))
    assert code == 0, err
    assert sorted(results(out)) == [0, 1], out


def test_a_c10d_rendezvous_on_one_node() -> None:
    code, out, err = run(
        tether(
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=localhost:{free_port()}",
            "--rdzv_id=101",
            "--nnodes=1",
            "--nproc_per_node=2",
            DDP,
        )
    )
    assert code == 0, err
    assert sorted(results(out)) == [0, 1], out


def run_two_nodes(rendezvous: str) -> List[Tuple[int, str, str]]:
    """Two launchers acting as two nodes of one job; (code, stdout, stderr) of each."""
    port = free_port()
    if rendezvous == "c10d":
        where = ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=pair"]
    else:
        where = ["--master_addr=127.0.0.1", f"--master_port={port}"]
    launchers = [
        subprocess.Popen(
            tether("--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1", *where, DDP),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        for node in (0, 1)
    ]
    outputs = []
    try:
        for launcher in launchers:
            out, err = launcher.communicate(timeout=200)
            outputs.append((launcher.returncode, out, err))
    except subprocess.TimeoutExpired:
        said = []
        for node, launcher in enumerate(launchers):
            launcher.kill()
            out, err = launcher.communicate()  # what each said until then, nothing lost
            said.append(f"-- node {node} (exit {launcher.returncode}):\n{out}\n{err}")
        pytest.fail("the two launchers did not end within 200 s:\n" + "\n".join(said))
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
                launcher.communicate()
    return outputs


@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_two_launchers_as_two_nodes(rendezvous: str) -> None:
    for _ in range(3):  # as in `run`: a rank that aborted inside gloo is no launcher's fault
        outputs = run_two_nodes(rendezvous)
        if not any(GLOO_ABORT in out + err for _, out, err in outputs):
            break
    found = {}
    for node, (code, out, err) in enumerate(outputs):
        assert code == 0, f"node {node}: {err}"
        # A static rendezvous ranks the nodes by --node-rank; c10d's ranks them itself (and
        # says that --node-rank is ignored), as torchrun does.
        if rendezvous == "static":
            assert list(results(out)) == [node], out
        else:
            assert len(results(out)) == 1 and "--node-rank" in err, (out, err)
        found.update(results(out))
    assert sorted(found) == [0, 1], found
    assert found[0][1] == found[1][1] == 2 and found[0][3] == found[1][3], found


def test_a_failing_rank_reads_in_order_without_a_doubled_prefix() -> None:
    # stdout and stderr on one pipe, as on a terminal.
    proc = subprocess.run(
        tether("--nproc_per_node=2", "--grace-period", "5", DDP, "--fail-rank", "1"),
        check=False,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=200,
        env=ENV,
    )
    text = proc.stdout
    assert proc.returncode == 1, text
    assert "[rank1]: Traceback (most recent call last):" in text, text
    assert "[rank 1]: [rank1]" not in text, text
    said = text.index("[rank 1]: rank 1 is about to fail")
    raised = text.index("[rank1]: Traceback")
    assert said < raised, text
    assert "rank 1 failed first (root cause)" in text[raised:]
    assert "[rank1]: ValueError: rank 1 diverged" in text[raised:]
