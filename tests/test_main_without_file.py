"""Functions, classes and instances of a ``__main__`` without a file (``python -c``, stdin, a
Jupyter-style kernel) travel by value: as spawn targets, as a DataLoader's dataset and
collate_fn on ``pool.context()``, as executor tasks, in every start method. Each program
runs in a fresh interpreter, three ways: ``python -c``, ``python -`` reading stdin, and
IPython's InteractiveShell running it cell by cell (as a notebook kernel does)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import List

import pytest

from tether.spawn.launch import START_METHODS

HERE = os.path.dirname(os.path.abspath(__file__))

#: A program's cells are separated by this line (for the kernel; -c and stdin run it whole).
CELL = "# %% next cell\n"

#: What a notebook kernel does with the cells: run each in one InteractiveShell, whose user
#: namespace is ``__main__`` (a module without a file).
KERNEL = """
import sys
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
for cell in sys.stdin.read().split(%r):
    if not shell.run_cell(cell).success:
        sys.exit(1)
""" % CELL

WAYS = ["python -c", "stdin", "kernel"]


def _run(program: str, way: str, timeout: float = 100) -> subprocess.CompletedProcess:
    """Runs ``program`` in a fresh interpreter ``way``; its ``__main__`` has no file."""
    code = textwrap.dedent(program)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    if way == "python -c":
        argv, stdin = [sys.executable, "-c", code], None
    elif way == "stdin":
        argv, stdin = [sys.executable, "-"], code
    else:
        argv, stdin = [sys.executable, "-c", KERNEL], code
    return subprocess.run(
        argv, input=stdin, capture_output=True, text=True, timeout=timeout, env=env, cwd=HERE
    )


def _lines(result: subprocess.CompletedProcess) -> List[str]:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.splitlines()


SPAWN = f"""
import os
import tether

class Tally:
    def __init__(self, method, n):
        self.method, self.n = method, n

class Refused(Exception):
    pass

def say(text):
    os.write(1, (text + "\\n").encode())  # one write: the ranks' lines never mix

def work(i, tally):
    say(f"{{tally.method}} rank {{i}}: {{type(tally).__name__}} {{tally.n + i}}")

def refuse(i):
    raise Refused(f"rank {{i}} refuses")
{CELL}
for method in {START_METHODS!r}:
    tether.start_processes(work, args=(Tally(method, 10),), nprocs=2, start_method=method)
    try:
        tether.start_processes(refuse, nprocs=1, start_method=method)
    except tether.ProcessRaisedException as error:
        cause = error.__context__
        assert str(error).endswith("Refused: rank 0 refuses\\n"), str(error)
        say(f"{{method}} raised {{type(cause).__name__}} {{type(cause) is Refused}} {{cause}}")
tether.spawn(lambda i: say(f"lambda rank {{i}}"), nprocs=1)
"""


@pytest.mark.parametrize("way", WAYS)
def test_spawn_runs_functions_and_classes_of_a_main_without_a_file_in_every_start_method(way):
    lines = _lines(_run(SPAWN, way))
    for method in START_METHODS:
        assert sorted(line for line in lines if line.startswith(f"{method} rank")) == [
            f"{method} rank 0: Tally 10",
            f"{method} rank 1: Tally 11",
        ]
        # The child's exception is rebuilt here as an instance of this __main__'s class.
        assert f"{method} raised Refused True rank 0 refuses" in lines
    assert "lambda rank 0" in lines


LOADERS = f"""
import torch
from torch.utils.data import DataLoader, Dataset
import tether

class Squares(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i * i])

def collate(batch):
    return [int(x) for x in torch.cat(batch)]
{CELL}
for method in {START_METHODS!r}:
    with tether.Pool(1, start_method=method) as pool:
        loader = DataLoader(
            Squares(6), batch_size=3, num_workers=1, collate_fn=collate,
            multiprocessing_context=pool.context(),
        )
        print(method, list(loader))
"""


@pytest.mark.parametrize("way", WAYS)
def test_a_pool_dataloader_takes_a_dataset_and_collate_fn_of_a_main_without_a_file(way):
    lines = _lines(_run(LOADERS, way))
    for method in START_METHODS:
        assert f"{method} [[0, 1, 4], [9, 16, 25]]" in lines


NOTEBOOK_CHANGES = f"""
import torch
from torch.utils.data import DataLoader, Dataset
import tether

SCALE, OFFSET = 1, 0

class Scaled(Dataset):
    step = 1

    def __init__(self, transform):
        self.transform = transform

    def __len__(self):
        return 3

    def __getitem__(self, i):
        return torch.tensor(self.transform(i) * SCALE + self.step)
{CELL}
def epochs(context):
    global SCALE, OFFSET
    SCALE, OFFSET, Scaled.step = 1, 0, 1
    dataset = Scaled(lambda i: i + OFFSET)
    seen = []
    for change in range(4):
        if change == 1:
            SCALE = 10  # a global its method reads
        if change == 2:
            OFFSET = 100  # a global its lambda reads
        if change == 3:
            Scaled.step = 7  # an attribute of its class
        loader = DataLoader(
            dataset, batch_size=None, num_workers=1, multiprocessing_context=context
        )
        seen.append([int(x) for x in loader])
    return seen
{CELL}
with tether.Pool(1) as pool:
    print("fork", epochs("fork"))
    print("pool", epochs(pool.context()))
"""


def test_what_a_notebook_changes_between_loaders_reaches_the_pool_as_it_reaches_fork():
    lines = _lines(_run(NOTEBOOK_CHANGES, "kernel"))
    expected = "[[1, 2, 3], [1, 11, 21], [1001, 1011, 1021], [1007, 1017, 1027]]"
    assert lines[-2:] == [f"fork {expected}", f"pool {expected}"]


EXECUTOR = f"""
import os
import tether

class Point:
    def __init__(self, x):
        self.x = x

    def doubled(self):
        return Point(2 * self.x)

class Refused(Exception):
    pass

def make(x):
    return Point(x)

def refuse(why):
    raise Refused(why)

def setup(value):
    # A global it assigns is its own copy (it travelled by value): state the tasks share
    # lives in an importable place.
    os.environ["CONFIGURED"] = str(value)

def configured_value():
    return int(os.environ["CONFIGURED"])
{CELL}
for method in {START_METHODS!r}:
    with tether.Pool(1, start_method=method, initializer=setup, initargs=(41,)) as pool:
        point = pool.submit(make, 3).result(timeout=60)
        assert type(point) is Point and point.x == 3, point
        assert [p.x for p in pool.map(make, range(4))] == [0, 1, 2, 3]
        assert pool.submit(Point(5).doubled).result(timeout=60).x == 10
        assert pool.submit(lambda y: y + 1, 1).result(timeout=60) == 2
        assert pool.submit(configured_value).result(timeout=60) == 41
        try:
            pool.submit(refuse, "no").result(timeout=60)
        except Refused as error:
            assert error.args == ("no",)
        print(method, "ok")
"""


@pytest.mark.parametrize("way", WAYS)
def test_executor_tasks_of_a_main_without_a_file_run_in_every_start_method(way):
    lines = _lines(_run(EXECUTOR, way))
    assert lines[-len(START_METHODS) :] == [f"{method} ok" for method in START_METHODS]


BY_REFERENCE = """
import sys
import pool_helpers
import tether

with tether.Pool(1) as pool:
    # The worker runs the module's own function (the one its module defines), not a copy.
    assert pool.submit(pool_helpers.in_its_module).result(timeout=60) is True
    assert list(pool.map(pool_helpers.square, range(3))) == [0, 1, 4]
tether.spawn(pool_helpers.spawn_in_its_module, nprocs=1)
# Nothing of __main__ travelled: tether never asked for cloudpickle.
print("cloudpickle imported:", "cloudpickle" in sys.modules)
"""


def test_objects_of_an_importable_module_still_travel_by_reference():
    assert _lines(_run(BY_REFERENCE, "python -c"))[-1] == "cloudpickle imported: False"


WITHOUT_CLOUDPICKLE = """
import sys
sys.modules["cloudpickle"] = None  # as if tether were installed without its dependencies
import pickle
import tether

def task():
    return 1

def rank(i):
    pass

with tether.Pool(1) as pool:
    try:
        pool.submit(task).result(timeout=60)
    except pickle.PicklingError as error:
        print("submit:", error)
    assert pool.submit(abs, -2).result(timeout=60) == 2  # the pool serves on
try:
    tether.spawn(rank, nprocs=1)
except pickle.PicklingError as error:
    print("spawn:", error)
"""


def test_with_cloudpickle_missing_an_object_of_such_a_main_fails_saying_how_to_install_it():
    lines = _lines(_run(WITHOUT_CLOUDPICKLE, "stdin"))
    assert [line.split(":")[0] for line in lines] == ["submit", "spawn"]
    for line, name in zip(lines, ("task", "rank")):
        assert f"the function {name} cannot travel to another process" in line
        assert "__main__ without a file" in line
        assert "a dependency of tether missing from this environment" in line
        assert line.endswith("pip install cloudpickle")


def test_cloudpickle_is_a_dependency_of_the_installed_package():
    from importlib.metadata import requires

    assert [r for r in requires("tether") or [] if r.startswith("cloudpickle")] == [
        "cloudpickle>=3.0"
    ]
