"""``tether run``'s warm ranks (forks of the node's zygote) show a rank exactly what ``python -u
SCRIPT ARGS`` shows it: the same probe (``scripts/warm_pkg/record.py``) runs under warm
``tether run``, under ``tether run --no-warm``, as ``python -u`` through ``--no-python`` and
under torchrun, as a script and as a module, in attempt 0 and in a restarted attempt 1; what
it records is compared fact by fact."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest

pytestmark = pytest.mark.timeout(300)

SCRIPTS = Path(__file__).resolve().parent / "scripts"
PROBE = str(SCRIPTS / "warm_probe.py")
PYTHON = sys.executable
TETHER = str(Path(PYTHON).with_name("tether"))
TORCHRUN = str(Path(PYTHON).with_name("torchrun"))

#: The umask and open-file limit every launcher runs under (a child that took the defaults
#: instead of the launcher's would show it).
UMASK = 0o027
NOFILE = 2000

#: Every launcher, with its options and what it runs (a script, or ``-m``).
LAUNCHERS: Dict[str, Callable[[List[str], List[str]], List[str]]] = {
    "warm": lambda options, target: [TETHER, "run", *options, *target],
    "no-warm": lambda options, target: [TETHER, "run", "--no-warm", *options, *target],
    "python -u": lambda options, target: [
        *[TETHER, "run", *options, "--no-python", PYTHON, "-u"],
        *target,
    ],
    "torchrun": lambda options, target: [TORCHRUN, *options, *target],
}
TARGETS = {"script": [PROBE], "module": ["-m", "warm_pkg.probe"]}

Records = Dict[str, Dict[str, Any]]


def _limits() -> None:
    os.umask(UMASK)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, hard))


def launch(argv: List[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(SCRIPTS), GLOO_SOCKET_IFNAME="lo", **env)
    full.pop("OMP_NUM_THREADS", None)
    return subprocess.run(
        argv,
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        timeout=240,
        preexec_fn=_limits,
        stdin=subprocess.DEVNULL,
    )


def probe(name: str, form: str, where: Path, **env: str) -> Records:
    """Runs the probe under launcher ``name`` (2 ranks, rank 0 of attempt 0 fails, one
    restart) with the output directory ``out`` in ``where`` (the same path for every
    launcher); returns its records by ``attempt.rank``."""
    out = where / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    options = ["--nproc-per-node", "2", "--max-restarts", "1"]
    argv = LAUNCHERS[name](options, [*TARGETS[form], "out", "x", "--y"])
    proc = launch(argv, where, PROBE_FAIL_FIRST="1", **env)
    assert proc.returncode == 0, proc.stderr
    records = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(records) == ["0.0", "0.1", "1.0", "1.1"], proc.stderr
    for key in records:
        assert (out / f"atexit.{key}").read_text() == "ran", f"{name}: atexit of {key}"
    return records


@pytest.fixture(scope="module", params=sorted(TARGETS))
def runs(request: Any, tmp_path_factory: Any) -> Tuple[str, Dict[str, Records]]:
    """The probe's records under every launcher, for a script or a module."""
    where = tmp_path_factory.mktemp("warm-probe")
    form = request.param
    return form, {name: probe(name, form, where) for name in LAUNCHERS}


#: What differs between any two runs or ranks: ids, times, random draws, paths under the
#: run's own temporary directory, ports.
PER_PROCESS = {"pid", "ppid", "started", "random", "authkey", "hash"}
PER_RUN_ENV = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RUN_ID"}
#: tether's stacks channel (a socket at fd 1000 or above, and the handlers of SIGRTMIN+4 and
#: +5): in every Python rank of tether run, not under --no-python nor torchrun.
STACK_SIGNALS = {signal.SIGRTMIN + 4, signal.SIGRTMIN + 5}


def comparable(record: Dict[str, Any], stacks: bool = True) -> Dict[str, Any]:
    facts = {k: v for k, v in record.items() if k not in PER_PROCESS}
    env = {k: v for k, v in facts.pop("env").items() if k not in PER_RUN_ENV}
    facts["env"] = env
    # (A cold rank's initial environment names the stacks channel and the job's id, which
    # its start-up then takes out.)
    hidden = PER_RUN_ENV | {"TETHER_STACKS_FD", "TETHER_JOB_ID"}
    shown = {e for e in facts.pop("proc_environ") if e and e.split("=")[0] not in hidden}
    facts["proc_environ"] = sorted(shown)
    if not stacks:
        facts["fds"] = {fd: what for fd, what in facts["fds"].items() if int(fd) < 1000}
        facts["signals"] = {
            sig: handler
            for sig, handler in facts["signals"].items()
            if int(sig) not in STACK_SIGNALS
        }
        caught = int(facts.pop("sig_caught"), 16)
        for sig in STACK_SIGNALS:
            caught &= ~(1 << (sig - 1))
        facts["sig_caught"] = f"{caught:016x}"
    for mask in ("sig_blocked", "sig_ignored", "sig_caught"):
        # Signals 32 and 33 are glibc's own (Python cannot name them): a torchrun rank
        # sometimes starts with 32 ignored.
        facts[mask] = int(str(facts[mask]), 16) & ~(0b11 << 31)
    return facts


def differences(ours: Dict[str, Any], theirs: Dict[str, Any]) -> Dict[str, Any]:
    return {
        k: (ours.get(k), theirs.get(k))
        for k in set(ours) | set(theirs)
        if ours.get(k) != theirs.get(k)
    }


def test_a_warm_rank_sees_what_python_dash_u_shows_it_in_both_attempts(runs) -> None:
    form, records = runs
    for key, warm in records["warm"].items():
        theirs = comparable(records["python -u"][key], stacks=False)
        assert differences(comparable(warm, stacks=False), theirs) == {}, (form, key)
        assert warm["umask"] == UMASK and warm["limits"]["RLIMIT_NOFILE"][0] == NOFILE


def test_a_warm_rank_sees_what_a_cold_rank_of_tether_run_sees(runs) -> None:
    form, records = runs
    for key, warm in records["warm"].items():
        theirs = comparable(records["no-warm"][key])
        assert differences(comparable(warm), theirs) == {}, (form, key)


#: Where tether run and torchrun differ on purpose (or torchrun shows its own): its ranks
#: share torchrun's stdout and stderr (tether's go through pipes), its rendezvous shares
#: the agent's store, tether's ranks answer for their stacks.
TORCHRUN_OWN = {"TORCHELASTIC_USE_AGENT_STORE"}


def test_a_warm_rank_sees_what_a_torchrun_rank_sees(runs) -> None:
    form, records = runs
    for key, warm in records["warm"].items():
        ours, theirs = comparable(warm, False), comparable(records["torchrun"][key], False)
        for facts in (ours, theirs):
            facts["fds"] = sorted(facts["fds"])
            facts["env"] = {k: v for k, v in facts["env"].items() if k not in TORCHRUN_OWN}
            facts["proc_environ"] = [
                e for e in facts["proc_environ"] if e.split("=")[0] not in TORCHRUN_OWN
            ]
        assert differences(ours, theirs) == {}, (form, key)


def test_a_rank_runs_the_script_as_its_main_module(runs) -> None:
    form, records = runs
    for warm in records["warm"].values():
        main = warm["main"]
        if form == "script":
            assert main == {"name": "__main__", "file": PROBE, "spec": None, "package": None}
            assert warm["path0"] == str(SCRIPTS)
        else:
            file = str(SCRIPTS / "warm_pkg" / "probe.py")
            assert main == {"name": "__main__", "file": file, "spec": "warm_pkg.probe"} | {
                "package": "warm_pkg"
            }
        assert warm["argv"][1:] == ["out", "x", "--y"] and warm["unbuffered"] == [True, True]
        assert warm["cmdline"] == [PYTHON, "-u", *TARGETS[form], "out", "x", "--y"]
        assert warm["comm"] == Path(PYTHON).name[:15]
        assert warm["sig_blocked"] == "0000000000000000"


def test_random_states_and_the_authkey_differ_between_ranks_and_attempts(runs) -> None:
    _, records = runs
    warm = records["warm"].values()
    for fact in ("random", "authkey", "pid"):
        values = [json.dumps(r[fact]) for r in warm]
        assert len(set(values)) == len(values), fact
    # Hash randomization is the zygote's: one seed for every rank of the node.
    assert len({r["hash"] for r in warm}) == 1
    assert len({r["hash"] for r in records["no-warm"].values()}) == 4


def test_each_rank_has_its_own_environment_before_its_first_line(runs) -> None:
    _, records = runs
    for key, warm in records["warm"].items():
        attempt, rank = key.split(".")
        env = warm["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (rank, rank, "2")
        assert env["TORCHELASTIC_RESTART_COUNT"] == attempt
        assert f"RANK={rank}" in warm["proc_environ"]
        assert "TETHER_WARM" not in env and "TETHER_WARM_ROOM" not in env


@pytest.fixture(scope="module")
def children(tmp_path_factory: Any) -> Dict[str, Records]:
    """The probe's children (spawn, fork, DataLoader workers, nested tether.spawn) under
    warm ranks, and under ``python -u``."""
    where = tmp_path_factory.mktemp("warm-children")
    return {
        name: probe(name, "script", where, PROBE_CHILDREN="1") for name in ("warm", "python -u")
    }


def test_a_warm_ranks_children_are_a_cold_ranks(children) -> None:
    for key, warm in children["warm"].items():
        seen = warm["children"]
        assert seen["spawn"] == {"name": "__mp_main__", "file": PROBE, "ok": True, "exitcode": 0}
        assert seen["fork"] == {"ppid": warm["pid"], "ok": True, "exitcode": 0}
        assert seen["dataloader"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        attempt, rank = key.split(".")
        assert seen["nested"] == [f"nested.{rank}.{attempt}.{i}" for i in range(2)]
        cold = children["python -u"][key]["children"]
        cold["fork"]["ppid"] = warm["pid"]
        assert seen == cold, key


def exits(script: str, tmp_path: Path, *options: str) -> Tuple[int, List[str]]:
    """Runs ``script`` on 1 rank; the launcher's status and the rank's stderr lines."""
    (tmp_path / "rank.py").write_text(script)
    proc = launch([TETHER, "run", "-n", "1", *options, "rank.py"], tmp_path)
    lines = proc.stdout.splitlines() + proc.stderr.splitlines()
    return proc.returncode, [line for line in lines if line.startswith("[rank 0]: ")]


@pytest.mark.parametrize(
    "script",
    [
        "import sys\nprint('bye')\nsys.exit(7)\n",
        "def deep():\n    raise ValueError('boom')\n\ndeep()\n",
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
        "import atexit\natexit.register(print, 'at exit')\nraise SystemExit('said')\n",
    ],
    ids=["exit-7", "exception", "sigkill", "atexit-and-message"],
)
def test_a_warm_rank_ends_as_a_cold_one(script: str, tmp_path: Path) -> None:
    warm = exits(script, tmp_path)
    cold = exits(script, tmp_path, "--no-warm")
    assert warm == cold
    assert warm[0] in (7, 1, 128 + signal.SIGKILL), warm
