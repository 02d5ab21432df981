"""Generated package/script pairs for the warm-rank harness (``test_warm_versus_cold.py``):
each package's import does one or several things a preload must not let show (prints,
warnings, variables and files read, files kept open, randomness, the clock, temporary
directories, signal handlers, exit functions, logging, threads, settings), and each script
imports it one way (unconditionally, under a flag it is not given, in a function) after
changing, or not, what the import reads (the environment through an alias or a helper,
``sys.path`` through an alias, warnings filters, a redirected stdout, the working
directory, the logging configuration).

Every script records, as JSON in ``OUT/<restart count>.<rank>.json``, what its rank sees
before and after the import: ``sys.modules``, warnings filters, exit functions, signal
handlers, the root logger, threads, fds, the environment, the working directory, and what
the package reports of itself. Values that each process draws for itself are recorded
under names starting with ``unique_``: the harness checks that they differ between every
rank and attempt, under every launcher."""

from __future__ import annotations

import random
import textwrap
from pathlib import Path
from typing import Dict, List, NamedTuple, Tuple

#: What a package's import does: (import-time code, facts ``report()`` returns).
BEHAVIOURS: Dict[str, Tuple[str, str]] = {
    "prints": ("print('imported', __name__)\nprint('on stderr', file=sys.stderr)", "{}"),
    "warns": ("warnings.warn('careful: ' + __name__, UserWarning)", "{}"),
    "deprecates": ("warnings.warn('old: ' + __name__, DeprecationWarning, stacklevel=2)", "{}"),
    "reads_env": ("MODE = os.environ.get('PKG_MODE', 'default')", "{'mode': MODE}"),
    "keeps_log": (
        "LOG = open(os.path.join(os.environ['PKG_DIR'], f'log.{os.getpid()}'), 'a')",
        "{'logged': _log()}",
    ),
    "uuid": ("import uuid\nID = uuid.uuid4().hex", "{'unique_id': ID}"),
    "rng": ("import random\nRNG = random.Random()", "{'unique_draw': RNG.random()}"),
    "clock": (
        "import time\nSTARTED = time.time()",
        "{'clock_read_after_the_script_started': STARTED >= sys.modules['__main__'].STARTED}",
    ),
    "tempdir": (
        "import tempfile, shutil, atexit\nTMP = tempfile.mkdtemp()\n"
        "atexit.register(shutil.rmtree, TMP, True)",
        "{'unique_tmp': TMP, 'tmp_exists': os.path.isdir(TMP)}",
    ),
    "handler": (
        "import signal\nsignal.signal(signal.SIGUSR1, lambda *a: None)",
        "{'handler': signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL}",
    ),
    "exit_fn": ("import atexit\natexit.register(print, 'bye from', __name__)", "{}"),
    "logging": (
        "import logging\nlogging.basicConfig(level=logging.DEBUG, format='PKG %(message)s')\n"
        "logging.getLogger(__name__).setLevel(logging.INFO)",
        "{'root_level': logging.getLogger().level}",
    ),
    "filters": ("warnings.filterwarnings('ignore', message='quiet')", "{}"),
    "thread": (
        "import threading, time\nthreading.Thread(target=time.sleep, args=(1,), "
        "daemon=True).start()",
        "{}",
    ),
    "reads_path": ("PATH_LENGTH = len(sys.path)", "{'path_length': PATH_LENGTH}"),
    "reads_argv": ("ARGS = list(sys.argv[2:])", "{'args': ARGS}"),
    "reads_cwd": ("CWD = os.getcwd()", "{'cwd': CWD}"),
    "sets_env": ("os.environ['PKG_SET'] = 'from ' + __name__", "{}"),
    "json": ("import json\nDUMPED = json.dumps({'a': 1})", "{'dumped': DUMPED}"),
}
#: Behaviours that need torch (slow to import: a few cases only).
TORCH_BEHAVIOURS: Dict[str, Tuple[str, str]] = {
    "dtype": (
        "import torch\ntorch.set_default_dtype(torch.float64)",
        "{'dtype': str(torch.get_default_dtype())}",
    ),
    "spawn_lock": ("import multiprocessing\nLOCK = multiprocessing.get_context('spawn').Lock()",
                   "{'spawn_child': _spawn_child()}"),
}

#: How a script imports the package, after what: (code before, how it imports).
VARIANTS: Dict[str, Tuple[str, str]] = {
    "top": ("", "import {pkg} as pkg"),
    "flag_off": ("", "pkg = None\nif '--flag' in sys.argv:\n    import {pkg} as pkg"),
    "function": ("def load():\n    import {pkg}\n    return {pkg}\n", "pkg = load()"),
    "env_alias": ("env = os.environ\nenv['PKG_MODE'] = 'alias'", "import {pkg} as pkg"),
    "env_helper": (
        "def load_dotenv():\n    os.environ.update(PKG_MODE='helper')\nload_dotenv()",
        "import {pkg} as pkg",
    ),
    "path_alias": ("path = sys.path\npath.append('/nowhere')", "import {pkg} as pkg"),
    "warnings_error": ("warnings.simplefilter('error')", "pkg = guarded('{pkg}')"),
    "warnings_ignore": ("warnings.simplefilter('ignore')", "import {pkg} as pkg"),
    "redirected": ("", "pkg = redirected('{pkg}')"),
    "chdir": ("os.chdir(os.environ['PKG_DIR'])", "import {pkg} as pkg"),
    "logging_first": (
        "import logging\nlogging.basicConfig(level=logging.WARNING, format='SCRIPT %(message)s')",
        "import {pkg} as pkg",
    ),
}

#: The script: records what its rank sees before and after the import.
SCRIPT = '''\
import time
STARTED = time.time()
import atexit, contextlib, io, json, os, signal, sys, warnings
OUT = sys.argv[1]
ATTEMPT, RANK = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
if __name__ == "__main__":  # (the last exit function to run: it says the rank has ended)
    atexit.register(lambda: open(os.path.join(OUT, f"ended.{{ATTEMPT}}.{{RANK}}"), "w").close())


def state():
    logging = sys.modules.get("logging")
    root = None if logging is None else logging.getLogger()
    fds = {{}}
    for fd in sorted(os.listdir("/proc/self/fd"), key=int):
        if int(fd) < 1000:
            try:
                target = os.readlink(f"/proc/self/fd/{{fd}}").split(":")[0]
                # A run of digits (a pid's, whatever its length) reads as one N.
                fds[fd] = "".join(
                    "N" if c.isdigit() else c
                    for i, c in enumerate(target)
                    if not (c.isdigit() and i and target[i - 1].isdigit())
                )
            except OSError:
                pass
    return {{
        "modules": sorted(sys.modules),
        "filters": [repr(f) for f in warnings.filters],
        "exit_functions": atexit._ncallbacks(),
        "usr1": getattr(signal.getsignal(signal.SIGUSR1), "__qualname__", None),
        "root": None if root is None else [root.level, len(root.handlers)],
        "tasks": len(os.listdir("/proc/self/task")),
        "fds": fds,
        "env": {{k: v for k, v in os.environ.items() if k.startswith("PKG_")}},
        "cwd": os.getcwd(),
    }}


def guarded(name):
    try:
        return __import__(name)
    except Warning as exc:
        return "raised " + type(exc).__name__ + ": " + str(exc)


def redirected(name):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        module = __import__(name)
    print("captured", json.dumps([out.getvalue(), err.getvalue()]))
    return module


BEFORE = state()
{before}
{imports}
AFTER = state()
if __name__ == "__main__":
    report = pkg if pkg is None or isinstance(pkg, str) else pkg.report()
    with open(os.path.join(OUT, f"{{ATTEMPT}}.{{RANK}}.json"), "w") as f:
        json.dump({{"before": BEFORE, "after": AFTER, "report": report}}, f, default=repr)
if __name__ == "__main__" and ATTEMPT == "0" and RANK == "0":
    import time
    deadline = time.monotonic() + 30
    others = [f"ended.0.{{r}}" for r in range(1, int(os.environ["WORLD_SIZE"]))]
    while not all(os.path.exists(os.path.join(OUT, e)) for e in others):
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    sys.exit(3)
'''

PACKAGE = '''\
import os, sys, warnings
{code}


def _log():
    try:
        LOG.write("logged\\n")
        LOG.flush()
        return "ok"
    except Exception as exc:
        return type(exc).__name__


def _spawn_child():
    import multiprocessing
    child = multiprocessing.get_context("spawn").Process(target=print, args=("child",))
    child.start()
    child.join(60)
    return child.exitcode


def report():
    import logging, signal
    facts = {{}}
{reports}
    return facts
'''


class Case(NamedTuple):
    """One package and the script that imports it."""

    name: str
    behaviours: Tuple[str, ...]
    variant: str


def cases(count: int = 160, torch_cases: int = 6, seed: int = 33) -> List[Case]:
    """``count`` pairs: every behaviour alone under every variant first (in a fixed order),
    then packages of two or three behaviours at random; ``torch_cases`` more with torch."""
    rng = random.Random(seed)
    singles = [((b,), v) for b in BEHAVIOURS for v in VARIANTS]
    rng.shuffle(singles)
    chosen = singles[: max(0, count - count // 4)]
    while len(chosen) < count:
        several = tuple(sorted(rng.sample(sorted(BEHAVIOURS), rng.choice((2, 3)))))
        chosen.append((several, rng.choice(sorted(VARIANTS))))
    with_torch = [
        ((b,), v) for b in TORCH_BEHAVIOURS for v in ("top", "flag_off", "function")
    ][:torch_cases]
    return [
        Case(f"pkg_{i:03d}", behaviours, variant)
        for i, (behaviours, variant) in enumerate(chosen + with_torch)
    ]


def write_package(site: Path, case: Case) -> None:
    """The package of ``case``, installed in ``site`` (with its ``.dist-info``)."""
    known = {**BEHAVIOURS, **TORCH_BEHAVIOURS}
    code = "\n".join(known[b][0] for b in case.behaviours)
    reports = "\n".join(f"    facts.update({known[b][1]})" for b in case.behaviours)
    package = site / case.name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(PACKAGE.format(code=code, reports=reports))
    info = site / f"{case.name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {case.name}\nVersion: 1.0\n")


def write_script(where: Path, case: Case) -> Path:
    before, imports = VARIANTS[case.variant]
    path = where / f"{case.name}_script.py"
    path.write_text(
        SCRIPT.format(before=before.format(pkg=case.name), imports=imports.format(pkg=case.name))
    )
    return path


def describe(case: Case) -> str:
    return f"{case.name}: {'+'.join(case.behaviours)} imported {case.variant}"


__all__ = ["Case", "cases", "write_package", "write_script", "describe", "textwrap"]
