"""The layout rules (tools/layout.py): short modules and functions, no circle of imports."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: The Rust crates (names under crates/) held to the rules, as the Python package is.
RUST_CRATES: tuple[str, ...] = ("tether-core", "tether-cli", "tether-py")


def _layout() -> Any:
    spec = importlib.util.spec_from_file_location("layout", ROOT / "tools" / "layout.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("layout", module)
    spec.loader.exec_module(module)
    return module


layout = _layout()


def test_the_python_package_keeps_the_layout_rules():
    assert layout.check_python() == []


def test_the_held_rust_crates_keep_the_layout_rules():
    assert {crate: layout.check_rust(crate) for crate in RUST_CRATES} == {
        crate: [] for crate in RUST_CRATES
    }


def test_the_checker_runs_as_a_script_and_names_every_crate():
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "layout.py")], capture_output=True, text=True
    )
    assert result.returncode in (0, 1), result.stderr
    assert result.stdout.strip().splitlines()[-1].endswith(("problem(s)", "is clean"))
    assert set(layout.rust_crates()) >= {"tether-core", "tether-cli", "tether-py"}


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_checker_finds_long_python_modules_functions_and_lazy_import_cycles(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(61))
    _write(
        tmp_path / "python" / "tether",
        {
            "__init__.py": "from . import a\n",
            "a.py": "from . import _native\n\ndef f():\n    from .b import g\n",
            "b.py": "import tether.a\n" + "\n" * 400,
            "c.py": f"class C:\n    def long(self):\n{body}\n",
        },
    )
    problems = layout.check_python(tmp_path)
    assert problems == [
        "python/tether/b.py: 401 lines (at most 400)",
        "python/tether/c.py:2: C.long has 62 lines (at most 60)",
        "python/tether: import cycle among a, b (e.g. a -> b -> a)",
    ]


def test_the_checker_follows_relative_imports_through_subpackages(tmp_path):
    _write(
        tmp_path / "python" / "tether",
        {
            "__init__.py": "",
            "z.py": "def f():\n    from .p.x import g\n",
            "p/__init__.py": "from typing import Any\n",
            "p/x.py": "from . import y\n",
            "p/y.py": "from .. import z\nfrom ... import outside\n",
            "p/q.py": "from ..p import x\nimport tether.p.y\n",
            "p/s/__init__.py": "from .. import q\nfrom ...z import f\n",
        },
    )
    assert layout.check_python(tmp_path) == [
        "python/tether: import cycle among p.x, p.y, z (e.g. p.x -> p.y -> z -> p.x)"
    ]


def test_the_checker_reads_rust_without_its_tests_strings_and_comments(tmp_path):
    long_fn = "fn long() {\n" + "    let _ = 1;\n" * 60 + "}\n"
    _write(
        tmp_path / "crates" / "k" / "src",
        {
            "lib.rs": "pub mod a;\npub mod b;\npub mod w;\npub use a::Thing;\n",
            "a.rs": """
                use crate::b::helper;
                pub struct Thing;
                // crate::w::never, in a comment
                const S: &str = "crate::w::never { in a string";
                const C: char = '{';
                fn f<'a>(x: &'a str) -> &'a str { helper(); x }
            """,
            "b.rs": "pub fn helper() { let _ = crate::Thing; }\n" + long_fn,
            "w/mod.rs": """
                mod inner;
                pub fn never() { inner::go() }
                #[cfg(test)]
                mod tests;
            """,
            "w/inner.rs": "pub fn go() {}\n" + "\n" * 600,
            "w/tests.rs": "use super::*;\n" + "\n" * 700,
        },
    )
    (tmp_path / "crates" / "k" / "src" / "w" / "inner.rs").write_text(
        "pub fn go() {}\n#[cfg(test)]\nmod tests {\n" + "\n" * 700 + "}\n"
    )
    assert layout.check_rust("k", tmp_path) == [
        "crates/k/src/b.rs:2: fn long has 62 lines (at most 60)",
        "crates/k/src: import cycle among a.rs, b.rs (e.g. a.rs -> b.rs -> a.rs)",
    ]
    layout.ALLOWED_CYCLES["k"] = [({"a.rs", "b.rs"}, "a handle and its thread")]
    try:
        assert layout.check_rust("k", tmp_path) == [
            "crates/k/src/b.rs:2: fn long has 62 lines (at most 60)"
        ]
    finally:
        del layout.ALLOWED_CYCLES["k"]


def test_the_checker_finds_a_circle_between_folders_that_no_two_files_make(tmp_path):
    _write(
        tmp_path / "crates" / "k" / "src",
        {
            "lib.rs": "pub mod server;\npub mod watcher;\npub mod record;\n",
            "server/mod.rs": "mod client;\nmod fork;\n",
            "server/client.rs": "use crate::watcher::thread::watch;\n",
            "server/fork.rs": "pub fn fork() {}\n",
            "watcher/mod.rs": "pub mod thread;\n",
            "watcher/thread.rs": "pub fn watch() { crate::server::fork::fork() }\n",
            "record.rs": "use crate::server::fork::fork;\n",
        },
    )
    circle = (
        "crates/k/src (top-level modules): import cycle among server, watcher"
        " (e.g. server -> watcher -> server)"
    )
    assert layout.check_rust("k", tmp_path, folders=True) == [circle]
    assert layout.check_rust("k", tmp_path) == []
    assert "tether-core" in layout.FOLDER_CRATES


def test_the_docs_list_the_start_methods_of_the_one_table():
    import tether
    from tether.spawn import launch

    page = (ROOT / "docs" / "spawn.md").read_text()
    table = page[page.index("| start method |") :].split("\n\n")[0].splitlines()[2:]
    names = [row.split("`")[1].strip('"') for row in table]
    assert tuple(names) == launch.START_METHODS
    assert [row for row in table if "(default)" in row] == [
        row for row in table if f'`"{launch.DEFAULT_START_METHOD}"`' in row
    ]
    assert all(f'"{method}"' in tether.start_processes.__doc__ for method in names)


def test_the_package_is_one_folder_per_room_and_the_public_names_stay_the_functions():
    package = ROOT / "python" / "tether"
    rooms = {p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == {"common", "pool", "run", "share", "spawn", "zygote"}
    flat = {p.name for p in package.glob("*.py")}
    assert flat == {"__init__.py", "__main__.py", "errors.py"}
    code = (
        "import types, tether, tether.share.items, tether.spawn.census\n"
        "from tether.share import meeting\n"
        "assert isinstance(tether.share, types.FunctionType), tether.share\n"
        "assert isinstance(tether.spawn, types.FunctionType), tether.spawn\n"
        "assert tether.share is meeting.share\n"
        "print(tether.share([1, 2]), tether.share.__module__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["tether.SharedList([1,", "2])", "tether.share.meeting"]


def test_a_type_checker_sees_the_public_functions_not_their_folders(tmp_path):
    code = "import tether\nreveal_type(tether.share)\nreveal_type(tether.spawn)\n"
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    revealed = [line for line in done.stdout.splitlines() if "Revealed type" in line]
    assert len(revealed) == 2 and all('"def (' in line for line in revealed), done.stdout
