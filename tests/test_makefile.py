"""The Makefile builds tether again only when what the build reads changed (``make demo`` and
``make test`` start at once otherwise), and always when it did: checked with ``make -q``
(exit 0 when nothing is to be done) on a copy of the Makefile in a tree of stand-ins whose
times the test sets."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import List

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent

#: What the build reads, and what it leaves (the compiled module, the two marks in .venv).
INPUTS = [
    "Cargo.toml",
    "Cargo.lock",
    "pyproject.toml",
    "crates/tether-core/Cargo.toml",
    "crates/tether-core/src/lib.rs",
    "crates/tether-py/src/workers/set.rs",
    "python/tether.data/purelib/tether_stacks.pth",
]
NOT_INPUTS = ["python/tether/pool/core.py", "README.md", "tests/test_pool.py", "examples/zygote.py"]
OUTPUTS = ["python/tether/_native.abi3.so", ".venv/.deps-installed", ".venv/.tether-built"]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """The Makefile among stand-ins of every file above: the inputs an hour old, the outputs
    made after them (as a finished build leaves them)."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    for name in INPUTS + NOT_INPUTS + OUTPUTS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    for name in ["Makefile", *INPUTS, *NOT_INPUTS]:
        _age(tmp_path / name, 3600)
    _age(tmp_path / ".venv/.deps-installed", 1800)
    for name in ["python/tether/_native.abi3.so", ".venv/.tether-built"]:
        _age(tmp_path / name, 60)  # a change now is later, whatever the clock's grain
    return tmp_path


def _age(path: Path, seconds: float) -> None:
    then = path.stat().st_mtime - seconds
    os.utime(path, (then, then))


def _up_to_date(tree: Path, targets: List[str]) -> bool:
    proc = subprocess.run(
        ["make", "-q", *targets], cwd=tree, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode == 0


def test_nothing_changed_nothing_is_built(tree: Path) -> None:
    assert _up_to_date(tree, ["build"])
    # What demo and test run first is the build: nothing else stands before their first line.
    dry = subprocess.run(["make", "-n", "demo"], cwd=tree, capture_output=True, text=True)
    assert "maturin" not in dry.stdout and "pip" not in dry.stdout, dry.stdout


@pytest.mark.parametrize("name", INPUTS)
def test_a_changed_input_of_the_build_builds_again(tree: Path, name: str) -> None:
    (tree / name).touch()
    assert not _up_to_date(tree, ["build"])
    dry = subprocess.run(["make", "-n", "demo"], cwd=tree, capture_output=True, text=True)
    assert "maturin develop --release" in dry.stdout, dry.stdout


@pytest.mark.parametrize("name", NOT_INPUTS)
def test_python_sources_and_the_rest_are_used_in_place(tree: Path, name: str) -> None:
    (tree / name).touch()
    assert _up_to_date(tree, ["build"])


def test_a_new_rust_file_or_a_missing_module_builds_again(tree: Path) -> None:
    (tree / "crates/tether-core/src/new.rs").write_text("")
    assert not _up_to_date(tree, ["build"])
    (tree / "crates/tether-core/src/new.rs").unlink()
    assert _up_to_date(tree, ["build"])
    (tree / "python/tether/_native.abi3.so").unlink()
    assert not _up_to_date(tree, ["build"])


def test_a_fresh_clone_sets_up_the_environment_then_builds(tree: Path) -> None:
    shutil.rmtree(tree / ".venv")
    (tree / "python/tether/_native.abi3.so").unlink()
    dry = subprocess.run(["make", "-n", "test"], cwd=tree, capture_output=True, text=True)
    lines = dry.stdout.splitlines()
    venv = next(i for i, line in enumerate(lines) if "-m venv .venv" in line)
    build = next(i for i, line in enumerate(lines) if "maturin develop --release" in line)
    assert venv < build < next(i for i, line in enumerate(lines) if "-m pytest" in line)
