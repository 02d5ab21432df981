"""``import tether as mp`` in a program written for ``import torch.multiprocessing as mp``:
every public name of torch.multiprocessing is reachable from tether (tether's own spawn API,
torch's the rest, imported on first use), and mnist_hogwild's pattern runs unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is a test dependency: `make test` installs it")

pytestmark = pytest.mark.timeout(240)

SCRIPTS = Path(__file__).parent / "scripts"


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_public_name_of_torch_multiprocessing_is_reachable_and_loaded_on_first_use():
    proc = run_python(
        """
        import sys
        import tether, tether.pool
        assert "torch" not in sys.modules, "import tether imported torch"
        assert "set_sharing_strategy" in dir(tether)
        queue_class = tether.SimpleQueue
        assert "torch" in sys.modules
        import torch.multiprocessing as tmp
        names = {n for n in dir(tmp) if not n.startswith("_")} - {"sys", "torch"}
        own = {"spawn", "start_processes", "ProcessContext", "SpawnContext",
               "ProcessRaisedException", "ProcessExitedException", "Pool"}
        for name in sorted(names):
            value = getattr(tether, name)
            if name in own:
                assert value.__module__.startswith("tether."), (name, value)
            else:
                assert value is getattr(tmp, name), name
        assert tether.Pool is tether.pool.Pool
        assert queue_class is tmp.SimpleQueue
        assert "file_descriptor" in tether.get_all_sharing_strategies()
        tether.set_sharing_strategy("file_system")
        assert tmp.get_sharing_strategy() == "file_system"
        try:
            tether.no_such_name
        except AttributeError as e:
            assert str(e) == "module 'tether' has no attribute 'no_such_name'", e
        else:
            raise AssertionError("no AttributeError")
        print("ok")
        """
    )
    assert (proc.returncode, proc.stdout.strip()) == (0, "ok"), proc.stderr


def test_without_torch_the_standard_librarys_names_stand_in_and_torchs_own_are_explained():
    proc = run_python(
        """
        import multiprocessing, sys
        sys.modules["torch"] = None  # as if torch were not installed
        import tether
        assert tether.Process is multiprocessing.Process
        assert tether.get_context is multiprocessing.get_context
        assert tether.multiprocessing is multiprocessing
        try:
            tether.set_sharing_strategy
        except AttributeError as e:
            print(e)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        "tether.set_sharing_strategy is torch.multiprocessing's, and torch is not installed"
    )


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_mnist_hogwilds_pattern_runs_unchanged_with_import_tether_as_mp(method, tmp_path):
    # torch's optimizers may leave a compile cache directory in TMPDIR: here, in tmp_path.
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "hogwild.py"), method],
        check=False,
        capture_output=True,
        text=True,
        timeout=200,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["start_method"] == method
    assert result["exitcodes"] == [0, 0]
    ranks = [r[0] for r in result["reports"]]
    pids = {r[1] for r in result["reports"]}
    assert ranks == [0, 1] and len(pids) == 2 and result["parent"] not in pids
    # Both ranks trained the parent's model in place, through shared memory.
    assert all(shared for _, _, shared in result["reports"])
    assert result["loss_after"] < result["loss_before"] / 2, result
