"""The wheel is all a user needs: built from a clean checkout by ``pip wheel .`` and by
``maturin build``, it is one abi3 wheel for the platform, and installed with ``pip install``
into a fresh virtual environment (which brings its one dependency, cloudpickle) its
``tether`` and ``python -m tether`` run ranks with that environment's Python, and what a
``python -c`` program defines travels to the pool."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Dict, List

import pytest

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]  # builds the wheel: minutes

ROOT = Path(__file__).resolve().parent.parent


def clean_checkout(dest: Path) -> Path:
    """The tracked and not ignored files of this checkout (no build outputs), copied to
    ``dest``."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    for name in filter(None, listing.split(b"\0")):
        source = ROOT / os.fsdecode(name)
        if source.is_file():
            target = dest / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


def build_env() -> Dict[str, str]:
    # Compiled dependencies are shared with this checkout's own build.
    return dict(os.environ, CARGO_TARGET_DIR=str(ROOT / "target"))


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """The wheel that ``pip wheel`` and the one that ``maturin build`` make of a clean
    checkout."""
    source = clean_checkout(tmp_path_factory.mktemp("checkout"))
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w"]
    maturin = [str(Path(sys.executable).with_name("maturin")), "build", "--release", "--out"]
    built = {}
    for how, argv in {"pip": [*pip, "{out}", "."], "maturin": [*maturin, "{out}"]}.items():
        out = tmp_path_factory.mktemp(f"wheel-{how}")
        argv = [str(out) if a == "{out}" else a for a in argv]
        proc = subprocess.run(argv, capture_output=True, text=True, env=build_env(), cwd=source)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (built[how],) = out.glob("*.whl")
    return built


def test_one_abi3_wheel_per_platform_with_the_launcher_inside(wheels: Dict[str, Path]) -> None:
    assert re.fullmatch(r"tether-[\d.]+-cp39-abi3-linux_x86_64\.whl", wheels["pip"].name)
    assert re.fullmatch(
        r"tether-[\d.]+-cp39-abi3-manylinux_2_\d+_x86_64\.whl", wheels["maturin"].name
    ), wheels["maturin"].name
    for wheel in wheels.values():
        with zipfile.ZipFile(wheel) as archive:
            names = archive.namelist()
            entry_points = next(n for n in names if n.endswith("entry_points.txt"))
            scripts = archive.read(entry_points).decode()
        assert "tether/_native.abi3.so" in names
        assert {"tether/run/cli.py", "tether/__main__.py"} <= set(names)
        assert "tether=tether.run.cli:main" in scripts.replace(" ", "")
        assert not any(n.startswith("tether/bin/") for n in names), names
        # Installed at site-packages' root: the hooks that let tether run's ranks answer for
        # their stacks, and make a node's zygote of warm ranks.
        data = re.compile(
            r"tether-[\d.]+\.data/purelib/(tether_(stacks|warm)\.pth|_tether_(stacks|warm)\.py)"
        )
        assert len([n for n in names if data.fullmatch(n)]) == 4, names


def fresh_venv(where: Path, wheel: Path) -> Path:
    """A new virtual environment with ``wheel`` installed as a user installs it (``pip
    install``, its dependencies with it); its Python."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=300)
    python = where / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", str(wheel)], check=True, timeout=300
    )
    return python


def run(argv: List[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        argv, check=False, capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


@pytest.mark.parametrize("how", ["pip", "maturin"])
def test_tether_run_from_a_fresh_venv_with_only_the_wheel(
    wheels: Dict[str, Path], how: str, tmp_path: Path
) -> None:
    python = fresh_venv(tmp_path / "venv", wheels[how])
    (tmp_path / "where.py").write_text(
        textwrap.dedent(
            """
            import os, sys
            print(os.environ["RANK"], os.environ["WORLD_SIZE"], sys.executable)
            """
        )
    )
    for argv in (
        [str(python.with_name("tether")), "run", "-n", "2", "where.py"],
        [str(python), "-m", "tether", "run", "--nproc_per_node=2", "-m", "where"],
    ):
        proc = run(argv, tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert sorted(proc.stdout.splitlines()) == [
            f"[rank {r}]: {r} 2 {python}" for r in range(2)
        ], proc.stdout
    help_text = run([str(python.with_name("tether")), "run", "--help"], tmp_path)
    assert help_text.returncode == 0 and "SCRIPT.py" in help_text.stdout
    # A rank of the installed wheel answers for its stack (tether_stacks.pth).
    (tmp_path / "stuck.py").write_text(
        "import time\ndef stuck_here():\n    time.sleep(60)\n"
        "print('ready', flush=True)\nstuck_here()\n"
    )
    timed_out = run(
        [str(python.with_name("tether")), "run", "--timeout", "3", "stuck.py"], tmp_path
    )
    assert timed_out.returncode == 124, timed_out.stderr
    assert '[rank 0]:   File "' in timed_out.stderr, timed_out.stderr
    assert 'stuck.py", line 3 in stuck_here' in timed_out.stderr, timed_out.stderr


NOTEBOOK = """
import importlib.metadata
import tether

class Squares:  # a Dataset, as a notebook defines one
    def __init__(self, n):
        self.n = n
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        return i * i

def total(dataset):
    return sum(dataset[i] for i in range(len(dataset)))

dataset = Squares(5)
with tether.Pool(2) as pool:
    print(pool.submit(total, dataset).result(timeout=60))
with tether.ProcessPoolExecutor(2) as executor:
    print(list(executor.map(dataset.__getitem__, range(5))))
print(importlib.metadata.requires("tether"), importlib.metadata.version("cloudpickle"))
"""


def test_a_python_c_programs_objects_cross_to_the_pool_right_after_pip_install(
    wheels: Dict[str, Path], tmp_path: Path
) -> None:
    python = fresh_venv(tmp_path / "venv", wheels["pip"])
    proc = run([str(python), "-c", NOTEBOOK], tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["30", "[0, 1, 4, 9, 16]"], proc.stdout
    assert lines[2].startswith("['cloudpickle>=3.0'] "), proc.stdout
