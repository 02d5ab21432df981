"""Random sequences of changes between loaders, made by the parent and by the workers
(``pool_random_script.py``, run as ``__main__``), give on ``pool.context()`` every batch
torch's fork workers give, and leave the parent's objects as fork leaves them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

SCRIPT = Path(__file__).with_name("pool_random_script.py")


@pytest.mark.parametrize("seed", [12, 31, 47])
def test_random_changes_between_loaders_give_what_fork_gives(seed):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(seed), "30"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=str(SCRIPT.parent),
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert result["loaders"] == 30
    assert result["differences"] == [], "\n".join(result["differences"])
