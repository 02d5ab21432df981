"""The docs keep ``tether run --help`` as the command prints it (docs/run.md, written by
tools/run_help.py): a change to an option shows in the page, or this test fails."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).with_name("tether")


def _tool() -> Any:
    spec = importlib.util.spec_from_file_location("run_help", ROOT / "tools" / "run_help.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_help = _tool()


def test_the_page_shows_the_help_as_the_command_prints_it() -> None:
    printed = run_help.printed(BIN)
    assert "Usage: tether run [OPTIONS] SCRIPT.py" in printed
    assert "--nproc-per-node" in printed and "--no-watch" in printed
    page = (ROOT / "docs" / "run.md").read_text()
    assert run_help.kept(page) == run_help.block(printed), (
        "docs/run.md keeps another help than `tether run --help` prints: "
        "run `python tools/run_help.py`"
    )


def test_the_check_fails_on_a_page_that_differs(tmp_path: Path, monkeypatch: Any) -> None:
    page = tmp_path / "run.md"
    text = (ROOT / "docs" / "run.md").read_text()
    kept = run_help.kept(text)
    page.write_text(text.replace(kept, kept.replace("--nproc-per-node", "--nproc-per-nod", 1)))
    monkeypatch.setattr(run_help, "PAGE", page)
    assert run_help.main(["--check", "--tether", str(BIN)]) == 1
    assert run_help.main(["--tether", str(BIN)]) == 0
    assert page.read_text() == text
    assert run_help.main(["--check", "--tether", str(BIN)]) == 0
