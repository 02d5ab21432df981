"""Keeps the help of ``tether run`` in the docs as the command prints it: ``python
tools/run_help.py`` writes ``tether run --help`` (100 columns) into docs/run.md between its
two markers; ``--check`` exits 1, saying so, when the page differs from the command
(``tests/test_run_help.py`` checks the same)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "run.md"
BEGIN = "<!-- tether run --help: begin (python tools/run_help.py writes it) -->"
END = "<!-- tether run --help: end -->"
#: The width the help is wrapped to (clap's own when stdout is no terminal).
COLUMNS = "100"


def printed(tether: Path) -> str:
    """What ``tether run --help`` prints, wrapped to ``COLUMNS``."""
    env = {**os.environ, "COLUMNS": COLUMNS}
    done = subprocess.run(
        [str(tether), "run", "--help"], capture_output=True, text=True, env=env, check=True
    )
    return done.stdout


def block(help_text: str) -> str:
    """The page's text between its markers for ``help_text``."""
    return f"{BEGIN}\n\n```text\n$ tether run --help\n{help_text.rstrip()}\n```\n\n{END}"


def kept(page: str) -> str:
    """The page's text between its markers, the markers included."""
    start, end = page.index(BEGIN), page.index(END) + len(END)
    return page[start:end]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only say whether it is current")
    parser.add_argument("--tether", type=Path, default=Path(sys.executable).with_name("tether"))
    args = parser.parse_args(argv)
    page = PAGE.read_text()
    current = block(printed(args.tether))
    if args.check:
        if kept(page) != current:
            print("docs/run.md: the help differs from `tether run --help`: run tools/run_help.py")
            return 1
        return 0
    PAGE.write_text(page.replace(kept(page), current))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
