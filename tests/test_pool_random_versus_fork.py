"""Random sequences of changes between loaders, made by the parent and by the workers
(``pool_random_script.py``, run as ``__main__``), give on ``pool.context()`` every batch
torch's fork workers give, and leave the parent's objects as fork leaves them."""

from __future__ import annotations

from pathlib import Path

import pytest
from pool_helpers import run_main_script

pytestmark = pytest.mark.timeout(300)

SCRIPT = Path(__file__).with_name("pool_random_script.py")


@pytest.mark.parametrize("seed", [12, 31, 47])
def test_random_changes_between_loaders_give_what_fork_gives(seed):
    result = run_main_script(SCRIPT, str(seed), "30")
    assert result["loaders"] == 30
    assert result["differences"] == [], "\n".join(result["differences"])
