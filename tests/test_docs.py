"""The documentation holds: every ```python block of the README and of the site's pages
(``docs/*.md``) runs as it stands, each in a fresh interpreter, as a reader would run it
(``python block.py``; a block whose first line says ``# NAME.py: run it with `tether run
... NAME.py``` is saved as NAME.py and run with that command line); the README stays short,
with its quick start on its first screen and a link to every page. (``make docs``, part of
``make test``, builds the site with ``mkdocs build --strict``.)"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

#: A block's first line that says how to launch it.
LAUNCH = re.compile(r"^# (?P<name>[\w-]+\.py): run it with `(?P<command>tether run [^`]*)`$")

#: How long one block may take (most take a few seconds; torch's import is most of it).
BLOCK_TIMEOUT = 150

#: The README's first screen: what a reader sees before scrolling.
FIRST_SCREEN_LINES = 60


class Block(NamedTuple):
    page: str
    line: int
    lang: str
    code: str


def blocks(path: Path) -> List[Block]:
    """The fenced code blocks of a page, with the line each opens on."""
    found: List[Block] = []
    lines = path.read_text().splitlines()
    opened = None
    for number, line in enumerate(lines, 1):
        fence = re.match(r"^\s*```(.*)$", line)
        if not fence:
            continue
        if opened is None:
            opened = (number, fence.group(1).strip())
        else:
            start, lang = opened
            name = str(path.relative_to(ROOT))
            found.append(Block(name, start, lang, "\n".join(lines[start : number - 1]) + "\n"))
            opened = None
    assert opened is None, f"{path}: a code block opened on line {opened[0]} is never closed"
    return found


PYTHON_BLOCKS = [b for page in PAGES for b in blocks(page) if b.lang == "python"]


def test_the_docs_have_python_examples_on_every_page_that_teaches_an_api() -> None:
    pages = {b.page for b in PYTHON_BLOCKS}
    for page in ["README.md", "docs/spawn.md", "docs/pool.md", "docs/executor.md",
                 "docs/share.md", "docs/run.md", "docs/debugging.md"]:
        assert page in pages, f"{page} has no Python example"


@pytest.mark.timeout(BLOCK_TIMEOUT + 30)
@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[f"{b.page}:{b.line}" for b in PYTHON_BLOCKS])
def test_every_python_block_runs_as_it_stands(block: Block, tmp_path: Path) -> None:
    first = block.code.splitlines()[0]
    launch = LAUNCH.match(first)
    if launch:
        script = launch.group("name")
        args = shlex.split(launch.group("command"))
        assert args[-1] == script, f"{block.page}:{block.line}: the command runs {args[-1]}"
        command = [sys.executable, "-m", "tether", *args[1:]]
    else:
        assert "tether run" not in first, (
            f"{block.page}:{block.line}: say `# NAME.py: run it with `tether run ... NAME.py``"
        )
        script = "block.py"
        command = [sys.executable, script]
    (tmp_path / script).write_text(block.code)
    proc = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=BLOCK_TIMEOUT
    )
    assert proc.returncode == 0, (
        f"{block.page}:{block.line} exited with {proc.returncode}\n"
        f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )


def test_every_code_block_names_its_language() -> None:
    """An untagged block is neither run nor knowingly left out: each says what it is
    (python, run by the test above; bash or text, shown only)."""
    for page in PAGES:
        for b in blocks(page):
            assert b.lang in ("python", "bash", "text"), f"{b.page}:{b.line}: ```{b.lang}"


def test_the_readme_is_short_and_opens_with_its_quick_start() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme) <= 12_000, len(readme)
    first_screen = "\n".join(readme.splitlines()[:FIRST_SCREEN_LINES])
    for needed in ["pip install .", "make demo", "make test", "tether run", "pool.context()"]:
        assert needed in first_screen, f"the README's first screen lacks {needed!r}"


def test_the_readme_links_every_page_of_the_site() -> None:
    readme = (ROOT / "README.md").read_text()
    for page in sorted(DOCS.glob("*.md")):
        assert f"](docs/{page.name}" in readme, f"the README does not link docs/{page.name}"


def test_the_site_lists_every_page_in_its_navigation() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    for page in sorted(DOCS.glob("*.md")):
        assert f": {page.name}\n" in config, f"mkdocs.yml's nav leaves out {page.name}"


def test_the_api_reference_draws_every_public_name_from_its_docstring() -> None:
    """Each ``::: path`` of docs/api.md names an object (a module stands for its public
    names); together they cover ``tether.__all__``, and each is the object ``tether`` gives."""
    import importlib

    import tether

    found = {}
    for path in re.findall(r"^::: ([\w.]+)$", (DOCS / "api.md").read_text(), re.M):
        try:
            module = importlib.import_module(path)
        except ImportError:
            owner, _, name = path.rpartition(".")
            found[name] = getattr(importlib.import_module(owner), name)
            continue
        own = [n for n, v in vars(module).items() if getattr(v, "__module__", "") == path]
        names = getattr(module, "__all__", None) or [n for n in own if not n.startswith("_")]
        found.update({n: getattr(module, n) for n in names})
    public = set(tether.__all__) - {"__version__"}
    assert public <= set(found), sorted(public - set(found))
    for name in public:
        assert found[name] is getattr(tether, name), name
        assert (found[name].__doc__ or "").strip(), f"{name} has no docstring"


def test_make_test_builds_the_site_strictly_and_leaves_nothing() -> None:
    dry = subprocess.run(
        ["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert dry.returncode == 0, dry.stderr
    recipe = [line for line in dry.stdout.splitlines() if "mkdocs build" in line]
    assert len(recipe) == 1 and "--strict" in recipe[0], dry.stdout
    assert "--quiet" not in recipe[0]  # mkdocs would not count the warnings --strict fails on
    assert "site=$(mktemp -d)" in dry.stdout and "trap 'rm -rf \"$site\"' EXIT" in dry.stdout
