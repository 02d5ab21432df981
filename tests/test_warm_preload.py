"""What a node's zygote preloads for ``tether run``'s warm ranks, and what it leaves to the
ranks: the installed packages a script imports (read from its source, and from the user's
own modules it imports), never the user's modules; a package whose import reads what
differs between ranks, does what belongs to one process, changes what tether cannot undo,
leaves a thread running or initializes CUDA is left to the ranks with a warning; a failing
preload, or a zygote that dies, never fails the job. What is preloaded shows in a rank only
from its own import on (``test_warm_visibility.py`` compares it with ``python -u``).
The packages here are made for the test in a directory named ``site-packages`` on
``PYTHONPATH``, which makes them installed packages."""

from __future__ import annotations

import ast
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from tether import _native
from tether.run.warm import scan as warm_scan
from tether.run.warm.record import signature
from tether.run.warm.start import packed_signatures

pytestmark = pytest.mark.timeout(240)

PYTHON = sys.executable
TETHER = str(Path(PYTHON).with_name("tether"))
ROOT = Path(__file__).resolve().parent.parent

#: Packages whose import reads what a rank has of its own, each keeping what it read.
READERS = {
    "reads_rank": ("import os\nSEEN = os.environ.get('RANK')\n", "os.environ['RANK']"),
    "reads_pid": ("import os\nSEEN = os.getpid()\n", "os.getpid()"),
    "reads_main": (
        "import __main__\nSEEN = getattr(__main__, '__file__', None)\n",
        "__main__.__file__",
    ),
    "copies_env": ("import os\nSEEN = dict(os.environ).get('RANK')\n", "os.environ['RANK']"),
}
WHY = {
    "reads_rank": "read $RANK",
    "reads_pid": "read the process id",
    "reads_main": "read __main__.__file__",
    "copies_env": "read the whole environment",
}
#: Packages whose import reads what a rank has too (the same there): they are preloaded,
#: and what they read is checked when the rank imports them.
SAME_IN_A_RANK = {
    "reads_argv": "import sys\nSEEN = list(sys.argv)\n",
    "reads_cwd": "import pathlib\nSEEN = str(pathlib.Path.cwd())\n",
}
PACKAGES = {
    **{name: source for name, (source, _) in READERS.items()},
    **SAME_IN_A_RANK,
    "starts_thread": (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), name='agent', daemon=True).start()\n"
    ),
    "marks_cuda": "import torch.cuda\ntorch.cuda._initialized = True\n",
    "broken": "raise ImportError('broken on purpose')\n",
    "says_hello": (
        "import sys\nprint('hello from says_hello')\nprint('to stderr', file=sys.stderr)\n"
    ),
    "clean": "import json\nVALUE = 42\n",
    "sets_env": "import os\nos.environ['FROM_PACKAGE'] = '1'\n",
    "adds_path": "import sys\nsys.path.append('/from-package')\n",
    "sets_handler": "import signal\nsignal.signal(signal.SIGUSR2, lambda *a: None)\n",
}
#: A package whose import waits (up to 30 s) for the file that WARM_TEST_GO names.
SLOW = """
import os, time
go, deadline = os.environ.get("WARM_TEST_GO", ""), time.monotonic() + 30
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.01)
"""
#: Packages whose import changes what tether cannot undo for a rank that does not import them.
CHANGERS = {
    "sets_env": "the environment",
    "adds_path": "sys.path",
}


@pytest.fixture(scope="module")
def site(tmp_path_factory: Any) -> Path:
    """A directory of installed packages made for these tests."""
    where = tmp_path_factory.mktemp("warm-preload") / "site-packages"
    where.mkdir()
    for name, source in PACKAGES.items():
        (where / f"{name}.py").write_text(source)
    return where


def run(argv: List[str], cwd: Path, site: Path, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(site), **env)
    return subprocess.run(argv, cwd=cwd, env=full, capture_output=True, text=True, timeout=200)


def write(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def test_a_rank_finds_the_first_file_changed_since_the_zygote_started(tmp_path: Path) -> None:
    paths = [tmp_path / name for name in ("same", "grown", "gone", "absent", "made")]
    for path in paths[:3]:
        path.write_text("x")
    packed = packed_signatures({str(p): signature(str(p)) for p in paths})
    assert _native.first_changed(*packed) is None
    (tmp_path / "made").write_text("")
    assert _native.first_changed(*packed) == 4
    (tmp_path / "gone").unlink()
    assert _native.first_changed(*packed) == 2
    with open(tmp_path / "grown", "a") as f:
        f.write("y")
    assert _native.first_changed(*packed) == 1
    with pytest.raises(ValueError, match="signature bytes"):
        _native.first_changed(packed[0], packed[1][:-1])
    with pytest.raises(ValueError, match="NUL"):
        _native.first_changed(packed[0][:-1], packed[1])


# What the zygote reads of a script -------------------------------------------------------


def test_a_scripts_imports_are_read_without_running_it(
    tmp_path: Path, site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(site))
    own = tmp_path / "mine"
    write(own / "__init__.py", "from . import model\n")
    write(own / "model.py", "import json\nfrom clean import VALUE\n")
    write(tmp_path / "numpy.py", "raise SystemExit('the user shadows numpy')\n")
    script = write(
        tmp_path / "train.py",
        """
        import os, sys
        from typing import TYPE_CHECKING
        import mine
        import numpy
        from torch.utils import data
        if TYPE_CHECKING:
            import says_hello
        def later():
            import broken
        raise SystemExit("never run")
        """,
    )
    search = [str(tmp_path), str(site), *sys.path]
    scan = warm_scan.Scan(warm_scan.Places(), search)
    scan.file(str(script), None)
    found = scan.found
    for name in ("os", "typing", "json", "clean", "torch.utils", "torch.utils.data"):
        assert name in found, (name, found)
    assert "sys" not in found  # built in: nothing to import
    assert "broken" in found  # an import in a function still counts
    # The user's own modules are read, never preloaded; one that shadows numpy is the user's.
    assert not {"mine", "mine.model", "numpy", "says_hello", "train"} & set(found), found
    assert {os.path.realpath(p) for p in scan.read} == {
        os.path.realpath(p)
        for p in (script, own / "__init__.py", own / "model.py", tmp_path / "numpy.py")
    }


def test_relative_imports_of_a_module_resolve_against_its_package() -> None:
    tree = ast.parse("from . import a\nfrom ..b import c\nfrom .d.e import f\nimport g.h")
    assert warm_scan.imports(tree, "pkg.sub") == [
        ("pkg.sub", ["a"]),
        ("pkg.b", ["c"]),
        ("pkg.sub.d.e", ["f"]),
        ("g.h", []),
    ]
    assert warm_scan.imports(ast.parse("from . import a"), None) == []


@pytest.mark.parametrize(
    "change",
    [
        'os.environ["OMP_NUM_THREADS"] = "4"',
        'os.environ.setdefault("MKL_NUM_THREADS", "1")',
        "os.putenv('A', 'b')",
        "environ.update(A='1')",
        "del os.environ['A']",
        "env = os.environ\nenv['A'] = '1'",
        "load_dotenv()",
        "sys.path.insert(0, '/vendored')",
        "sys.path[:0] = ['/vendored']",
        "path = sys.path\npath.append('/vendored')",
        "site.addsitedir('/vendored')",
        "os.chdir('/')",
        "importlib.import_module('json')",
        "print(parse())",
        "Config().load()",
    ],
)
def test_no_import_after_code_that_may_change_what_imports_read_is_in_the_prefix(
    change: str, tmp_path: Path
) -> None:
    write(
        tmp_path / "mine.py",
        "import os, sys, site, importlib\nfrom os import environ\n"
        "def load_dotenv():\n    pass\ndef parse():\n    return 1\nclass Config:\n    pass\n"
        f"{change}\n",
    )
    script = write(
        tmp_path / "train.py",
        "import json\nimport mine\nimport numpy\nimport torch\n",
    )
    scan = warm_scan.Scan(warm_scan.Places(), [str(tmp_path), *sys.path])
    scan.file(str(script), None)
    assert {"json", "numpy", "torch"} <= set(scan.found)
    assert "json" in scan.prefix and not {"numpy", "torch"} & scan.prefix, scan.prefix


@pytest.mark.parametrize(
    "harmless",
    [
        "marks, mode = Path(sys.argv[1]), sys.argv[2]",
        "attempt = os.environ['TORCHELASTIC_RESTART_COUNT']",
        "parser = argparse.ArgumentParser()\nparser.add_argument('--lr')\n"
        "args = parser.parse_args()",
        "logging.basicConfig(level=logging.INFO)\nlog = logging.getLogger(__name__)",
        "with open(__file__) as f:\n    text = f.read()",
        "config = {}\nconfig['lr'] = 0.1\nfor k in sorted(config):\n    config[k] = str(k)",
        "Path('out').resolve().exists()",
    ],
)
def test_harmless_code_before_an_import_keeps_it_in_the_prefix(
    harmless: str, tmp_path: Path
) -> None:
    script = write(
        tmp_path / "train.py",
        f"import os, sys, argparse, logging\nfrom pathlib import Path\n{harmless}\nimport torch\n",
    )
    scan = warm_scan.Scan(warm_scan.Places(), [str(tmp_path), *sys.path])
    scan.file(str(script), None)
    assert "torch" in scan.prefix, scan.prefix


def test_the_prefix_is_what_runs_before_any_code_that_may_change_what_imports_read(
    tmp_path: Path,
) -> None:
    script = write(
        tmp_path / "train.py",
        """
        \"\"\"A training script.\"\"\"
        from __future__ import annotations
        import os, warnings
        from typing import TYPE_CHECKING
        warnings.filterwarnings("ignore")
        print("starting")
        try:
            import numpy
        except ImportError:
            numpy = None
        if TYPE_CHECKING:
            import says_hello
        SIZE = 3 * 4
        class Model:
            depth = SIZE
            @property
            def width(self):
                import csv
                return 2
        def main():
            import json
        if os.environ.get("FLAG"):
            import torch
        import decimal
        parser = Model()
        import fractions
        if __name__ == "__main__":
            main()
        """,
    )
    scan = warm_scan.Scan(warm_scan.Places(), [str(tmp_path), *sys.path])
    scan.file(str(script), None)
    assert scan.prefix == {"os", "warnings", "typing", "numpy", "decimal"}, scan.prefix
    assert {"csv", "json", "torch", "fractions"} <= set(scan.found) - scan.prefix


# What the zygote leaves to the ranks -------------------------------------------------------


@pytest.fixture(scope="module")
def left_out(site: Path, tmp_path_factory: Any) -> subprocess.CompletedProcess:
    """Two warm ranks of a script that imports every test package."""
    where = tmp_path_factory.mktemp("warm-left-out")
    names = sorted(READERS)
    script = write(
        where / "rank.py",
        f"""
        import json, os, signal, sys
        print("first line", "FROM_PACKAGE" in os.environ, "/from-package" in sys.path,
              signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL, "sets_handler" in sys.modules)
        import sets_env, adds_path, sets_handler
        print("handler", signal.getsignal(signal.SIGUSR2) is sets_handler.signal.getsignal(
              signal.SIGUSR2), signal.getsignal(signal.SIGUSR2) != signal.SIG_DFL)
        import clean, starts_thread, marks_cuda, says_hello, reads_argv, reads_cwd
        import {", ".join(names)}
        try:
            import broken
        except ImportError as exc:
            print("broken:", exc)
        own = {{"RANK": os.environ["RANK"], "argv": sys.argv, "pid": os.getpid(),
               "cwd": os.getcwd(), "file": __file__}}
        seen = {{name: sys.modules[name].SEEN for name in {names + sorted(SAME_IN_A_RANK)!r}}}
        print("seen", json.dumps([own, seen]))
        """,
    )
    return run([TETHER, "run", "-n", "2", str(script), "arg"], where, site)


def test_a_package_that_reads_what_a_rank_has_of_its_own_is_left_to_the_ranks(left_out) -> None:
    assert left_out.returncode == 0, left_out.stderr
    for line in left_out.stdout.splitlines():
        if " seen " not in line:
            continue
        own, seen = json_tail(line)
        assert seen["reads_rank"] == own["RANK"] and seen["copies_env"] == own["RANK"]
        assert seen["reads_argv"] == own["argv"] and seen["reads_pid"] == own["pid"]
        assert seen["reads_cwd"] == own["cwd"] and seen["reads_main"] == own["file"]
    for name, why in WHY.items():
        assert re.search(
            rf"tether: warning: warm ranks: {name} is left out of the zygote's preload "
            rf"\(its import {re.escape(why)}, in {name}\); each rank imports it itself",
            left_out.stderr,
        ), (name, left_out.stderr)


def test_a_package_that_changes_what_tether_cannot_undo_is_left_to_the_ranks(left_out) -> None:
    assert sorted(line for line in left_out.stdout.splitlines() if "first line" in line) == [
        f"[rank {r}]: first line False False True False" for r in range(2)
    ]
    # A signal handler is the import's to set, at the import: it is preloaded.
    assert sorted(line for line in left_out.stdout.splitlines() if "handler" in line) == [
        f"[rank {r}]: handler True True" for r in range(2)
    ]
    assert "sets_handler is left out" not in left_out.stderr
    for name, what in CHANGERS.items():
        assert (
            f"tether: warning: warm ranks: {name} is left out of the zygote's preload (its "
            f"import changed {what}); each rank imports it itself" in left_out.stderr
        ), (name, left_out.stderr)


def json_tail(line: str) -> Any:
    import json

    return json.loads(line.split(" seen ", 1)[1])


def test_a_package_that_starts_a_thread_or_initializes_cuda_is_left_out_with_a_warning(
    left_out,
) -> None:
    assert (
        "warm ranks: starts_thread is left out of the zygote's preload (its import left a "
        "thread running ('agent'))" in left_out.stderr
    ), left_out.stderr
    assert (
        "warm ranks: marks_cuda is left out of the zygote's preload (its import initialized "
        "CUDA)" in left_out.stderr
    ), left_out.stderr


def test_a_broken_preload_still_runs_the_job(left_out) -> None:
    assert left_out.returncode == 0, left_out.stderr
    assert (
        "tether: warning: warm ranks: cannot preload broken (ImportError: broken on purpose); "
        "each rank imports it itself" in left_out.stderr
    ), left_out.stderr
    lines = sorted(left_out.stdout.splitlines())
    assert [line for line in lines if "broken:" in line] == [
        f"[rank {r}]: broken: broken on purpose" for r in range(2)
    ]
    # Every other warning is about a module left out: the ranks themselves are warm.
    warnings = [line for line in left_out.stderr.splitlines() if "warning" in line]
    assert len(warnings) == len(WHY) + len(CHANGERS) + 3, left_out.stderr
    assert "warm ranks are off" not in left_out.stderr


def test_what_a_preloaded_package_prints_shows_in_every_rank(left_out) -> None:
    for rank in range(2):
        assert f"[rank {rank}]: hello from says_hello" in left_out.stdout
        assert f"[rank {rank}]: to stderr" in left_out.stderr


def test_a_zygote_killed_before_the_first_rank_still_runs_the_job(
    site: Path, tmp_path: Path
) -> None:
    (site / "slow_to_import.py").write_text(SLOW)
    script = write(
        tmp_path / "rank.py", "import os, slow_to_import\nprint('ran', os.environ['RANK'])\n"
    )
    go = tmp_path / "go"
    launcher = subprocess.Popen(
        [TETHER, "run", "-n", "2", str(script)],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(site), WARM_TEST_GO=str(go)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        zygote = wait_for_zygote(launcher.pid)
        os.kill(zygote, signal.SIGKILL)
        go.touch()  # the ranks, cold, import it at once
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, err
    assert sorted(out.splitlines()) == ["[rank 0]: ran 0", "[rank 1]: ran 1"]
    assert err.count("warning") == 1, err
    assert (
        f"tether: warning: warm ranks are off for this run: the tether zygote (pid {zygote}) "
        "died with signal SIGKILL; every rank starts as a new interpreter (as with --no-warm)"
        in err
    ), err


def test_a_zygote_that_is_not_ready_holds_no_run_past_its_timeout(
    site: Path, tmp_path: Path
) -> None:
    (site / "slow_to_import.py").write_text(SLOW)
    script = write(tmp_path / "rank.py", "import slow_to_import\n")
    began = time.monotonic()
    proc = run([TETHER, "run", "-n", "1", "--timeout", "2", str(script)], tmp_path, site)
    assert proc.returncode == 124, proc.stderr
    assert time.monotonic() - began < 20
    assert (
        "tether: warning: warm ranks are off for this run: it was not ready when the run "
        "reached its --timeout of 2 s" in proc.stderr
    ), proc.stderr


def descendants(pid: int) -> List[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in map(int, f.read().split()):
                    found += [child, *descendants(child)]
    except OSError:
        pass
    return found


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def wait_for_zygote(launcher: int) -> int:
    """The pid of the zygote that launcher ``launcher`` started, once it preloads."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = [pid for pid in descendants(launcher) if comm(pid) == "tether-zygote"]
        if found:
            return found[0]
        time.sleep(0.01)
    raise AssertionError("no zygote")


# Restarts, --no-python, the rendezvous helper, the standalone binary ----------------------


def test_a_restart_forks_from_the_same_zygote_and_imports_nothing_again(tmp_path: Path) -> None:
    script = write(
        tmp_path / "rank.py",
        """
        import os, sys
        print("torch was there", "torch" in sys.modules)
        import torch
        print("torch served", torch.ones(1).item(), id(torch))
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
            sys.exit(3)
        """,
    )
    proc = run(
        [TETHER, "run", "-n", "2", "--max-restarts", "1", str(script)],
        tmp_path,
        tmp_path,
        TETHER_LOG="info",
    )
    assert proc.returncode == 0, proc.stderr
    # torch is the zygote's (the same object in every rank of both attempts: each imported
    # it from the zygote), yet no rank sees it before its own import.
    assert proc.stdout.count("torch was there False") == 4, proc.stdout
    served = re.findall(r"torch served 1.0 (\d+)", proc.stdout)
    assert len(served) == 4 and len(set(served)) == 1, proc.stdout
    assert proc.stderr.count("started the zygote of the warm ranks") == 1, proc.stderr
    started = re.findall(r"attempt (\d): started 2 rank\(s\), pids \[(\d+), (\d+)\]", proc.stderr)
    assert [a for a, *_ in started] == ["0", "1"], proc.stderr
    for _, *pids in started:
        for pid in pids:
            assert re.search(rf"adopted pid {pid} \((a fork|a blank)", proc.stderr), proc.stderr


#: A rank of the head-start tests: a script of torch's, whose rank 0 hosts a listening socket
#: at MASTER_PORT (as torch's store does) after a moment of other work, or never listens;
#: every rank writes when it started, and rank 0 when it listened; rank 1 fails in attempt 0,
#: so that the restart is seen too.
HOSTS_STORE = """
import os, socket, sys, time
import torch
from pathlib import Path
began = time.time()
out, listens = Path(sys.argv[1]), sys.argv[2] == "listens"
rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
if rank == "0":
    time.sleep(0.01)
    if listens:
        server = socket.create_server(("127.0.0.1", int(os.environ["MASTER_PORT"])))
        (out / f"listened-{attempt}").write_text(repr(time.time()))
    others = [out / f"began-{attempt}-{r}" for r in range(1, int(os.environ["WORLD_SIZE"]))]
    while not all(p.exists() for p in others):
        time.sleep(0.005)
(out / f"began-{attempt}-{rank}").write_text(repr(began))
if attempt == "0" and rank == "1":
    sys.exit(3)
"""


def run_hosting_a_store(tmp_path: Path, listens: str) -> Tuple[Dict[str, float], str]:
    """Runs HOSTS_STORE on 3 ranks, warm; returns when each rank began and rank 0 listened,
    and the launcher's log."""
    script = write(tmp_path / "rank.py", HOSTS_STORE)
    out = tmp_path / "out"
    out.mkdir()
    argv = [TETHER, "run", "--standalone", "-n", "3", "--max-restarts", "1"]
    proc = run([*argv, str(script), str(out), listens], tmp_path, tmp_path, TETHER_LOG="info")
    assert proc.returncode == 0, proc.stderr
    assert "adopted pid" in proc.stderr, proc.stderr  # the ranks were forks of the zygote
    assert proc.stderr.count("the other ranks start") == 2, proc.stderr
    return {p.name: float(p.read_text()) for p in out.iterdir()}, proc.stderr


def test_a_warm_start_forks_the_other_ranks_once_rank_0_listens_on_master_port(
    tmp_path: Path,
) -> None:
    # Forked at once, a rank would connect to rank 0's store before it listens, be refused,
    # and torch's client would wait about half a second before it tried again.
    times, log = run_hosting_a_store(tmp_path, "listens")
    assert log.count("rank 0 listens on port") == 2, log
    for attempt in (0, 1):
        listened = times[f"listened-{attempt}"]
        for rank in (1, 2):
            assert times[f"began-{attempt}-{rank}"] >= listened, (attempt, rank, times)


def test_rank_0_that_does_not_listen_holds_the_other_ranks_back_a_moment_only(
    tmp_path: Path,
) -> None:
    times, log = run_hosting_a_store(tmp_path, "never")
    # In each attempt the others waited for the head start's 50 ms, then started all the same.
    assert log.count("did not listen on port") == 2 and "within 250ms" in log, log
    assert sorted(times) == [f"began-{a}-{r}" for a in (0, 1) for r in (0, 1, 2)], times


def test_the_ranks_of_a_script_without_torch_start_together(tmp_path: Path) -> None:
    script = write(tmp_path / "rank.py", "import os\nprint('rank', os.environ['RANK'])\n")
    proc = run([TETHER, "run", "-n", "3", str(script)], tmp_path, tmp_path, TETHER_LOG="info")
    assert proc.returncode == 0, proc.stderr
    assert "adopted pid" in proc.stderr and "the other ranks start" not in proc.stderr


def test_no_python_commands_start_as_before(tmp_path: Path) -> None:
    proc = run(
        [TETHER, "run", "-n", "2", "--no-python", PYTHON, "-c", "import os; print(os.getppid())"],
        tmp_path,
        tmp_path,
        TETHER_LOG="info",
    )
    assert proc.returncode == 0, proc.stderr
    assert "zygote" not in proc.stderr
    assert len(re.findall(rf'started pid \d+: \["{re.escape(PYTHON)}", "-c"', proc.stderr)) == 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("imports_torch", [True, False])
def test_a_nodes_rendezvous_helper_is_a_fork_of_its_zygote_when_the_script_imports_torch(
    imports_torch: bool, tmp_path: Path
) -> None:
    source = "import os\nprint('rank', os.environ['RANK'])\n"
    if imports_torch:
        source += "import torch\n"
    script = write(tmp_path / "rank.py", source)
    argv = [TETHER, "run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    argv += ["--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "warm", str(script)]
    env = dict(os.environ, TETHER_LOG="info")
    nodes = [
        subprocess.Popen(
            argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=200))
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.communicate()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    lines = sorted(line for out, _ in outputs for line in out.splitlines())
    assert lines == ["[rank 0]: rank 0", "[rank 1]: rank 1"], outputs
    for _, err in outputs:
        # Forked, the helper is one more process taken from the zygote beside the rank; a
        # script that does not import torch keeps its ranks free of it, and the helper is a
        # new interpreter.
        forks = re.findall(r"adopted pid \d+ \(a (?:fork|blank)", err)
        assert len(forks) == (2 if imports_torch else 1), err
        assert err.count("started the zygote of the warm ranks") == 1, err


def standalone_binary() -> Path:
    """The ``tether`` binary that cargo builds (built here if no test built it yet)."""
    binary = ROOT / "target" / "debug" / "tether"
    if not binary.exists():
        subprocess.run(
            ["cargo", "build", "-p", "tether-cli", "--bin", "tether"],
            cwd=ROOT,
            check=True,
            timeout=900,
            capture_output=True,
        )
    return binary


@pytest.mark.timeout(960)
def test_the_standalone_binary_forks_warm_ranks_from_python_exec(tmp_path: Path) -> None:
    script = write(
        tmp_path / "rank.py", "import os, sys\nprint(os.environ['RANK'], sys.argv[1:])\n"
    )
    proc = run(
        [str(standalone_binary()), "run", "-n", "2", str(script), "a"],
        tmp_path,
        tmp_path,
        PYTHON_EXEC=PYTHON,
        TETHER_LOG="info",
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[rank 0]: 0 ['a']", "[rank 1]: 1 ['a']"]
    assert "warning" not in proc.stderr and "zygote (pid" in proc.stderr, proc.stderr


def test_pet_no_warm_starts_every_rank_as_a_new_interpreter(tmp_path: Path) -> None:
    script = write(tmp_path / "rank.py", "print('cold')\n")
    for env in ({"PET_NO_WARM": "1"}, {"PET_NO_WARM": "true"}):
        proc = run(
            [TETHER, "run", "-n", "1", str(script)], tmp_path, tmp_path, TETHER_LOG="info", **env
        )
        assert proc.returncode == 0 and "zygote" not in proc.stderr, proc.stderr
    proc = run(
        [TETHER, "run", "-n", "1", str(script)],
        tmp_path,
        tmp_path,
        TETHER_LOG="info",
        PET_NO_WARM="0",
    )
    assert proc.returncode == 0 and "zygote" in proc.stderr, proc.stderr
