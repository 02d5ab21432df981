"""A warm rank is the program ``python -u SCRIPT`` runs: one test for each way a preload used
to show (what the whole harness, ``test_warm_versus_cold.py``, checks on generated pairs).
Each runs the same script under warm ``tether run`` and under ``tether run --no-warm`` (a
new interpreter per rank, as torchrun starts them) and compares what the ranks say.

The packages are installed for the test in a folder on ``PYTHONPATH`` that holds their
``.dist-info``, as ``pip install --target`` leaves it."""

from __future__ import annotations

import _bisect
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

pytestmark = pytest.mark.timeout(300)

PYTHON = sys.executable
TETHER = str(Path(PYTHON).with_name("tether"))


def install(site: Path, name: str, source: str) -> None:
    """A package ``name`` installed in ``site``."""
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text(textwrap.dedent(source))
    info = site / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")


class Job:
    """What the ranks of one ``tether run`` said: their lines by rank, and the launcher's."""

    def __init__(self, proc: subprocess.CompletedProcess) -> None:
        self.code = proc.returncode
        self.stderr = proc.stderr
        self.lines: Dict[str, List[str]] = {}
        for line in (proc.stdout + proc.stderr).splitlines():
            found = re.match(r"\[rank (\d+)\]: (.*)", line)
            if found:
                self.lines.setdefault(found.group(1), []).append(found.group(2))

    def facts(self, rank: str = "0") -> List[object]:
        """What rank ``rank`` printed as ``FACT <json>``, in order."""
        return [
            json.loads(line[5:]) for line in self.lines.get(rank, []) if line.startswith("FACT ")
        ]


def run(
    where: Path,
    script: str,
    site: Optional[Path] = None,
    options: Tuple[str, ...] = (),
    args: Tuple[str, ...] = (),
    **env: str,
) -> Job:
    path = where / "script.py"
    path.write_text(textwrap.dedent(script))
    full = dict(os.environ, **env)
    if site is not None:
        full["PYTHONPATH"] = str(site)
    full.pop("OMP_NUM_THREADS", None)
    argv = [TETHER, "run", "-n", "2", *options, str(path), *args]
    return Job(
        subprocess.run(argv, cwd=where, env=full, capture_output=True, text=True, timeout=240)
    )


def both(
    where: Path, script: str, site: Optional[Path] = None, **kwargs: object
) -> Tuple[Job, Job]:
    """The script under warm ranks, then under ``--no-warm``."""
    warm = run(where, script, site, **kwargs)  # type: ignore[arg-type]
    options = tuple(kwargs.pop("options", ())) + ("--no-warm",)  # type: ignore[arg-type]
    cold = run(where, script, site, options=options, **kwargs)  # type: ignore[arg-type]
    return warm, cold


@pytest.fixture
def site(tmp_path: Path) -> Path:
    where = tmp_path / "site"
    where.mkdir()
    return where


def test_a_rank_that_fails_flushes_the_files_its_script_left_open(tmp_path: Path) -> None:
    # Rank 1 fails once rank 0's file shows its line (written at rank 0's exit), so that the
    # job never stops rank 0 before it got there (a new interpreter may start later than rank 1).
    script = """
    import os, sys, time
    def helper():  # a function at module level: the module's globals are in a cycle
        pass
    rank, run = os.environ["RANK"], os.environ["TETHER_TEST_RUN"]
    data = open(f"data.{rank}.{run}", "w")
    data.write(f"rank {rank} wrote this\\n")
    if rank == "1":
        other, deadline = f"data.0.{run}", time.monotonic() + 60
        while time.monotonic() < deadline:
            if os.path.exists(other) and open(other).read():
                break
            time.sleep(0.01)
        raise RuntimeError("rank 1 fails")
    sys.exit(0)
    """
    for how in ("warm", "cold"):
        options = ("--no-warm",) if how == "cold" else ()
        job = run(tmp_path, script, options=options, TETHER_TEST_RUN=how)
        assert job.code == 1, job.stderr
        for rank in ("0", "1"):
            assert (tmp_path / f"data.{rank}.{how}").read_text() == f"rank {rank} wrote this\n"


def test_a_file_a_package_keeps_open_from_its_import_is_the_ranks_own(
    tmp_path: Path, site: Path
) -> None:
    install(
        site,
        "keeps_log",
        """
        import os
        LOG = open(os.path.join(os.environ["LOG_DIR"], f"log.{os.getpid()}"), "a")
        def log(text):
            LOG.write(text + "\\n")
            LOG.flush()
        """,
    )
    script = """
    import os, json
    import keeps_log
    data = open(f"data.{os.environ['RANK']}", "w")
    keeps_log.log("from rank " + os.environ["RANK"])
    held = f"/proc/self/fd/{keeps_log.LOG.fileno()}"
    print("FACT", json.dumps(os.path.samefile(keeps_log.LOG.name, held)))
    """
    (tmp_path / "logs").mkdir()
    warm = run(tmp_path, script, site, LOG_DIR=str(tmp_path / "logs"))
    assert warm.code == 0, warm.stderr
    assert warm.facts("0") == [True] and warm.facts("1") == [True], warm.lines
    logs = sorted(p.read_text() for p in (tmp_path / "logs").iterdir())
    assert logs == ["from rank 0\n", "from rank 1\n"]
    assert "keeps_log is left out" in warm.stderr  # its import keeps a file open


def test_a_spawn_lock_made_at_import_leaves_spawn_children_working(
    tmp_path: Path, site: Path
) -> None:
    install(
        site,
        "spawn_lock",
        """
        import multiprocessing
        LOCK = multiprocessing.get_context("spawn").Lock()
        """,
    )
    script = """
    import multiprocessing, json
    import spawn_lock
    if __name__ == "__main__":
        child = multiprocessing.get_context("spawn").Process(target=print, args=("child",))
        child.start()
        child.join(60)
        print("FACT", json.dumps(child.exitcode))
    """
    warm, cold = both(tmp_path, script, site)
    assert warm.code == cold.code == 0, warm.stderr
    assert warm.facts("0") == cold.facts("0") == [0]


def test_an_import_under_a_flag_not_given_shows_nothing_of_its_package(
    tmp_path: Path, site: Path
) -> None:
    install(
        site,
        "takes_over",
        """
        import logging, torch
        torch.set_default_dtype(torch.float64)
        logging.basicConfig(level=logging.DEBUG, format="TAKEN %(message)s")
        """,
    )
    script = """
    import json, logging, sys
    import torch
    if "--flag" in sys.argv:
        import takes_over
    root = logging.getLogger()
    print("FACT", json.dumps([str(torch.get_default_dtype()), root.level, len(root.handlers),
                              "takes_over" in sys.modules]))
    """
    warm, cold = both(tmp_path, script, site)
    assert warm.code == cold.code == 0, warm.stderr
    assert warm.facts("0") == cold.facts("0") == [["torch.float32", 30, 0, False]]
    flagged, cold_flagged = both(tmp_path, script, site, args=("--flag",))
    assert flagged.facts("1") == cold_flagged.facts("1") == [["torch.float64", 10, 1, True]]


def test_what_an_import_draws_or_makes_is_each_ranks_and_attempts_own(
    tmp_path: Path, site: Path
) -> None:
    # (Made under tmp_path: a rank stopped by the other's failure runs no atexit.)
    install(
        site,
        "draws",
        f"""
        import random, shutil, tempfile, time, uuid, atexit
        ID = uuid.uuid4().hex
        DRAW = random.Random().random()
        TMP = tempfile.mkdtemp(dir={str(tmp_path)!r})
        atexit.register(shutil.rmtree, TMP, True)
        AT = time.time()
        """,
    )
    script = """
    import time
    STARTED = time.time()
    import json, os, sys
    import draws
    print("FACT", json.dumps([draws.ID, draws.DRAW, draws.TMP, draws.AT >= STARTED]))
    time.sleep(0.3)  # (the other rank ends first: its directory is its own)
    print("FACT", json.dumps(os.path.isdir(draws.TMP)))
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        sys.exit(1)
    """
    job = run(tmp_path, script, site, options=("--max-restarts", "1"))
    facts = job.facts("0") + job.facts("1")
    drawn = [f for f in facts if isinstance(f, list)]
    assert len(drawn) == 4, job.stderr  # two ranks, two attempts
    for column in range(3):
        assert len({f[column] for f in drawn}) == 4, drawn
    assert all(f[3] for f in drawn) and all(f is True for f in facts if not isinstance(f, list))


@pytest.mark.parametrize(
    "change",
    [
        "env = os.environ\nenv['PKG_MODE'] = 'changed'",
        "def load_dotenv():\n    os.environ.update(PKG_MODE='changed')\nload_dotenv()",
        "path = sys.path\npath.insert(0, os.environ['EXTRA'])",
    ],
    ids=["environ-alias", "dotenv-helper", "sys-path-alias"],
)
def test_a_change_the_scan_cannot_see_reaches_the_import(
    change: str, tmp_path: Path, site: Path
) -> None:
    install(
        site,
        "configured",
        "import os, sys\nMODE = os.environ.get('PKG_MODE', 'default')\nFIRST = sys.path[0]\n",
    )
    script = f"""
    import json, os, sys
    {textwrap.indent(change, "    ").strip()}
    import configured
    print("FACT", json.dumps([configured.MODE, configured.FIRST]))
    """
    extra = tmp_path / "extra"
    extra.mkdir()
    warm, cold = both(tmp_path, textwrap.dedent(script), site, EXTRA=str(extra))
    assert warm.code == cold.code == 0, warm.stderr
    assert warm.facts("0") == cold.facts("0") and warm.facts("1") == cold.facts("1")


@pytest.mark.parametrize("action", ["error", "ignore", "default"])
def test_an_imports_warnings_follow_the_ranks_filters(
    action: str, tmp_path: Path, site: Path
) -> None:
    install(site, "warns", "import warnings\nwarnings.warn('careful', UserWarning)\n")
    script = f"""
    import json, warnings
    warnings.simplefilter({action!r})
    try:
        import warns
        print("FACT", json.dumps("imported"))
    except UserWarning as exc:
        print("FACT", json.dumps("raised " + str(exc)))
    """
    warm, cold = both(tmp_path, script, site)
    assert warm.code == cold.code == 0, warm.stderr
    assert warm.lines == cold.lines
    assert any("raised careful" in line or "careful" in line for line in warm.lines["0"]) == (
        action != "ignore"
    )


def test_what_an_import_prints_goes_where_the_rank_sends_its_output(
    tmp_path: Path, site: Path
) -> None:
    install(site, "chatty", "import sys\nprint('hello')\nprint('oops', file=sys.stderr)\n")
    script = """
    import contextlib, io, json
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        import chatty
    print("FACT", json.dumps([out.getvalue(), err.getvalue()]))
    """
    warm, cold = both(tmp_path, script, site)
    assert warm.lines == cold.lines and warm.facts("0") == [["hello\n", "oops\n"]], warm.lines


def test_a_preloaded_packages_state_shows_only_from_its_import_on(
    tmp_path: Path, site: Path
) -> None:
    install(
        site,
        "stateful",
        """
        import atexit, signal, warnings
        warnings.filterwarnings("ignore", message="stateful")
        signal.signal(signal.SIGUSR1, lambda *a: None)
        atexit.register(print, "bye")
        """,
    )
    script = """
    import atexit, json, signal, sys, warnings
    def state():
        return [len(warnings.filters), atexit._ncallbacks(),
                signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
                "stateful" in sys.modules, "__mp_main__" in sys.modules]
    print("FACT", json.dumps(state()))
    import stateful
    print("FACT", json.dumps(state()))
    """
    warm, cold = both(tmp_path, script, site)
    assert warm.lines == cold.lines, (warm.lines, cold.lines)
    assert warm.facts("0")[0][2:] == [True, False, False]


@pytest.mark.parametrize("name", ["json", "logging", "subprocess", "resource"])
def test_a_module_next_to_the_script_shadows_the_standard_librarys(
    name: str, tmp_path: Path
) -> None:
    (tmp_path / f"{name}.py").write_text("MINE = True\n")
    script = f"""
    import {name}
    print("FACT", getattr({name}, "MINE", False) and "true" or "false")
    """
    warm, cold = both(tmp_path, script)
    assert warm.facts("0") == cold.facts("0") == [True], (warm.lines, warm.stderr)


def test_a_start_up_hook_that_reads_a_ranks_variable_keeps_warm_ranks_off(
    tmp_path: Path, site: Path
) -> None:
    (site / "sitecustomize.py").write_text("import os\nRANK_SEEN = os.environ.get('RANK')\n")
    script = """
    import json, sitecustomize
    print("FACT", json.dumps(sitecustomize.RANK_SEEN))
    """
    warm = run(tmp_path, script, site)
    assert warm.facts("0") == ["0"] and warm.facts("1") == ["1"], warm.lines
    assert re.search(
        r"warm ranks are off for this run: a start-up hook \(sitecustomize\) would run in the "
        r"zygote only, and it read \$RANK",
        warm.stderr,
    ), warm.stderr


def test_a_start_up_hook_that_reads_nothing_of_a_rank_keeps_warm_ranks_on(
    tmp_path: Path, site: Path
) -> None:
    (site / "sitecustomize.py").write_text("import os\nHOME_SEEN = os.environ.get('HOME')\n")
    script = """
    import json, sitecustomize
    print("FACT", json.dumps(sitecustomize.HOME_SEEN == __import__("os").environ.get("HOME")))
    """
    warm = run(tmp_path, script, site)
    assert warm.facts("0") == [True] and "warm ranks are off" not in warm.stderr, warm.stderr


def test_a_script_edited_before_a_restart_runs_as_edited(tmp_path: Path, site: Path) -> None:
    install(site, "configured", "import os\nMODE = os.environ.get('PKG_MODE', 'default')\n")
    script = """
    import json, os, sys
    import configured
    print("FACT", json.dumps(configured.MODE))
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "0":
        edited = open(__file__).read().replace("import configured\\n",
            "env = os.environ\\nenv['PKG_MODE'] = 'edited'\\nimport configured\\n", 1)
        open(__file__, "w").write(edited)
        sys.exit(1)
    """
    job = run(tmp_path, script, site, options=("--max-restarts", "1"))
    assert job.code == 0, job.stderr
    assert job.facts("0") == ["default", "edited"] and job.facts("1")[-1] == "edited", job.lines


def test_a_compiled_packages_file_changed_before_a_restart_is_read_again(
    tmp_path: Path, site: Path
) -> None:
    # A package whose import loads compiled code cannot be imported again in a rank: a file
    # its import read that changed since the zygote started makes the next attempt's ranks
    # new interpreters, which read it as it is now.
    install(site, "compiled", "from . import _bisect\nfrom .level import LEVEL\n")
    shutil.copy(_bisect.__file__, site / "compiled" / Path(_bisect.__file__).name)
    (site / "compiled" / "level.py").write_text("LEVEL = 1\n")
    script = f"""
    import json, os, sys, time
    import compiled
    print("FACT", json.dumps(compiled.LEVEL))
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        if os.environ["RANK"] == "1":
            time.sleep(120)  # stopped when rank 0 fails
        with open({str(site / "compiled" / "level.py")!r}, "w") as f:
            f.write("LEVEL = 22\\n")
        sys.exit(1)
    """
    job = run(tmp_path, script, site, options=("--max-restarts", "1"), TETHER_LOG="info")
    assert job.code == 0, job.stderr
    assert job.facts("0") == [1, 22] and job.facts("1")[-1] == 22, job.lines
    assert "level.py changed since the zygote started" in job.stderr, job.stderr


def test_a_package_on_pythonpath_with_its_dist_info_counts_as_installed(
    tmp_path: Path, site: Path
) -> None:
    install(site, "bar", "VALUE = 1\n")  # as pip install --target leaves it: bar-1.0.dist-info
    install(site, "uses_bar", "import bar\nVALUE = bar.VALUE + 1\n")
    script = """
    import json
    import uses_bar
    print("FACT", json.dumps(uses_bar.VALUE))
    """
    job = run(tmp_path, script, site, TETHER_LOG="info")
    assert job.facts("0") == [2] and "a module of yours" not in job.stderr, job.stderr
    assert re.search(r"the zygote \(pid \d+\) is ready: 2 module\(s\) preloaded", job.stderr)
