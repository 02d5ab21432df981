"""The layout rules of the project, checked: run ``python tools/layout.py`` (from anywhere)
to see every place that breaks one; it exits 1 when there is any.

- a Python module of python/tether (its subpackages' too) has at most 400 lines;
- a Rust file under crates/*/src has at most 600 lines, not counting its test code
  (``#[cfg(test)]`` items: the ``mod tests`` block, test-only helpers, a test module's file);
- a function has at most 60 lines (Python: from ``def`` to its last line, by ``ast``; Rust: a
  ``fn`` item from its name to its closing brace, outside test code);
- no two files import each other, directly or round a longer circle. Python: the imports
  among tether's modules, those inside functions included. Rust: the paths between files of
  one crate (``use crate::...``, ``super::...``, ``self::...`` and a child module's name, in
  ``use`` items and in code), a re-export (``pub use``) followed to the file that defines
  the item (a re-export is no edge of its own: a module's face is not a dependency).
  ``ALLOWED_CYCLES`` lists the few circles a design keeps on purpose;
- in the crates of ``FOLDER_CRATES``, no two top-level modules (a folder such as ``zygote/``,
  or a file such as ``group.rs``) import each other, directly or round a longer circle,
  through any of their files: each concern's folder depends on others one way only.

``tests/test_layout.py`` holds the Python package to these rules, and the Rust crates it
names."""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "tether"
#: The compiled module of the package (Rust: it imports nothing of the package).
NATIVE = "_native"
MAX_PYTHON_MODULE = 400
MAX_RUST_FILE = 600
MAX_FUNCTION = 60

#: Circles between files kept on purpose, by crate: each entry is the set of files (paths
#: relative to the crate's src/) and why. The one kind allowed is a handle and the thread
#: it drives (the handle sends the thread requests; the thread's loop calls back into the
#: handle's types): put the pair here with a line saying so.
ALLOWED_CYCLES: Dict[str, List[Tuple[Set[str], str]]] = {}
#: The crates whose top-level modules are held to the rule of no circle among them.
FOLDER_CRATES: Set[str] = {"tether-core", "tether-cli"}


# -- cycles ---------------------------------------------------------------------------------


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(edges.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def _circle(component: List[str], edges: Dict[str, Set[str]]) -> List[str]:
    """One circle through the component's first node, for the report (breadth first)."""
    start = component[0]
    members = set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for succ in sorted(edges.get(node, set()) & members):
            if succ == start:
                return paths[node] + [start]
            if succ not in paths:
                paths[succ] = paths[node] + [succ]
                queue.append(succ)
    return component


def _cycle_lines(edges: Dict[str, Set[str]], allowed: Iterable[Set[str]], where: str) -> List[str]:
    """One line per circle of files: its members, and one circle through the first."""
    allowed = list(allowed)
    return [
        f"{where}: import cycle among {', '.join(component)}"
        f" (e.g. {' -> '.join(_circle(component, edges))})"
        for component in cycles(edges)
        if set(component) not in allowed
    ]


# -- Python ---------------------------------------------------------------------------------


def _python_modules(package: Path) -> Dict[str, Path]:
    """Module name -> file, for every .py file of the package and of its subpackages: a
    module by its dotted name below the package (``spawn``, ``pool.core``), a subpackage by
    its own (``pool``), the package's own ``__init__`` as ``__init__``."""
    found: Dict[str, Path] = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package).with_suffix("").parts)
        if len(parts) > 1 and parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _python_functions(tree: ast.AST) -> Iterator[Tuple[str, int, int]]:
    """(qualified name, first line, line count) of every function, nested ones included."""

    def walk(node: ast.AST, prefix: str) -> Iterator[Tuple[str, int, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                end = child.end_lineno or child.lineno
                yield name, child.lineno, end - child.lineno + 1
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)

    return walk(tree, "")


def _nearest(dotted: str, modules: Set[str]) -> str:
    """The module a dotted name below the package is, or else the nearest package above it
    (a name that is no module is an attribute of that package's ``__init__``)."""
    while dotted and dotted not in modules:
        dotted = dotted.rpartition(".")[0]
    return dotted or "__init__"


def _import_base(node: ast.ImportFrom, home: List[str]) -> Optional[str]:
    """The dotted name below the package that ``from <base> import ...`` names (the package
    itself: ""), or None when it is outside the package; ``home`` is the package the
    importing module lives in."""
    if node.level >= 1:
        if node.level - 1 > len(home):
            return None
        anchor = home[: len(home) - (node.level - 1)]
        return ".".join(anchor + (node.module.split(".") if node.module else []))
    if node.module == PACKAGE:
        return ""
    if (node.module or "").startswith(PACKAGE + "."):
        return (node.module or "")[len(PACKAGE) + 1 :]
    return None


def _python_imports(
    tree: ast.AST, modules: Set[str], name: str = "__init__", package: bool = True
) -> Set[str]:
    """The package's modules that the module ``name`` (a package's ``__init__`` when
    ``package``) imports, anywhere in it (``from . import x``, ``from .x import y``,
    ``from ..x import y``, ``import tether.x``, ``from tether.x import y``); a name that is no
    module stands for the ``__init__`` of the nearest package above it, except the compiled
    ``_native`` (no file of the package: it imports none of them)."""
    modules = modules | {NATIVE}
    here = [] if name == "__init__" else name.split(".")
    home = here if package else here[:-1]
    found: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _import_base(node, home)
            if base is None:
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                found.add(full if full in modules else _nearest(base, modules))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == PACKAGE:
                    found.add(_nearest(".".join(parts[1:]), modules))
    return found - {NATIVE}


def check_python(root: Path = ROOT) -> List[str]:
    """Every break of the rules in python/tether, one line each."""
    package = root / "python" / PACKAGE
    modules = _python_modules(package)
    problems: List[str] = []
    edges: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        rel = path.relative_to(root)
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > MAX_PYTHON_MODULE:
            problems.append(f"{rel}: {lines} lines (at most {MAX_PYTHON_MODULE})")
        tree = ast.parse(source, str(path))
        for function, line, length in _python_functions(tree):
            if length > MAX_FUNCTION:
                problems.append(f"{rel}:{line}: {function} has {length} lines (at most 60)")
        package = path.name == "__init__.py"
        edges[name] = _python_imports(tree, set(modules), name, package) - {name}
    return problems + _cycle_lines(edges, [], f"python/{PACKAGE}")


# -- Rust: text ------------------------------------------------------------------------------

_CHAR = re.compile(r"'(?:\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]{1,6}\}|.)|[^\\'\n])'")
_RAW = re.compile(r'b?r(#*)"')


def mask(source: str) -> str:
    """``source`` with comments and the insides of string and char literals blanked out
    (newlines kept), so that braces and paths can be read off what is left."""
    out: List[str] = []
    i, n = 0, len(source)

    def blank(text: str) -> str:
        return re.sub(r"[^\n]", " ", text)

    while i < n:
        c = source[i]
        if source.startswith("//", i):
            end = source.find("\n", i)
            end = n if end < 0 else end
            out.append(blank(source[i:end]))
            i = end
        elif source.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if source.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif source.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(blank(source[i:j]))
            i = j
        elif (raw := _RAW.match(source, i)) and (i == 0 or not _ident(source[i - 1])):
            close = '"' + raw.group(1)
            end = source.find(close, raw.end())
            end = n if end < 0 else end + len(close)
            out.append('""' + blank(source[i + 2 : end]))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and source[j] != '"':
                j += 2 if source[j] == "\\" else 1
            out.append('"' + blank(source[i + 1 : j]) + '"')
            i = j + 1
        elif c == "'" and (char := _CHAR.match(source, i)):
            out.append("' '" + blank(source[i + 3 : char.end()]))
            i = char.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _ident(c: str) -> bool:
    return c.isalnum() or c == "_"


def _item_end(text: str, start: int) -> int:
    """The end of the item whose header starts at ``start``: past its matching closing brace,
    or past its ``;`` when it has no body."""
    depth = 0
    i = start
    while i < len(text):
        c = text[i]
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == ";" and depth == 0:
            return i + 1
        elif c == "{" and depth == 0:
            return _matching(text, i) + 1
        i += 1
    return len(text)


def _matching(text: str, open_at: int) -> int:
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return len(text) - 1


_CFG_TEST = re.compile(r"#\[cfg\(test\)\]")
_ATTRIBUTE = re.compile(r"\s*#\[[^\]]*\]")


def without_tests(text: str) -> Tuple[str, List[str], int]:
    """The masked text with every ``#[cfg(test)]`` item blanked out (newlines kept), the
    names of the test modules declared as files (``#[cfg(test)] mod tests;``), and how many
    lines the test items took."""
    test_files: List[str] = []
    test_lines = 0
    while True:
        found = _CFG_TEST.search(text)
        if found is None:
            return text, test_files, test_lines
        start = found.end()
        while (attribute := _ATTRIBUTE.match(text, start)) is not None:
            start = attribute.end()
        end = _item_end(text, start)
        declared = re.match(r"\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", text[start:end])
        if declared:
            test_files.append(declared.group(1))
        test_lines += text.count("\n", found.start(), end) + 1
        text = text[: found.start()] + re.sub(r"[^\n]", " ", text[found.start() : end]) + text[end:]


_FN = re.compile(r"\bfn\s+(\w+)")


def rust_functions(text: str) -> Iterator[Tuple[str, int, int]]:
    """(name, first line, line count) of every ``fn`` with a body in masked text."""
    for found in _FN.finditer(text):
        end = _item_end(text, found.end())
        if text[end - 1] != "}":
            continue  # a declaration without a body
        first = text.count("\n", 0, found.start()) + 1
        last = text.count("\n", 0, end - 1) + 1
        yield found.group(1), first, last - first + 1


# -- Rust: modules and paths ---------------------------------------------------------------------


class RustFile:
    """One file of a crate: its module path (``("workers", "gate")``), its masked text
    without test code, and what it declares."""

    def __init__(self, path: Path, module: Tuple[str, ...]) -> None:
        self.path = path
        self.module = module
        self.text, self.test_modules, self.test_lines = without_tests(mask(path.read_text()))
        self.children = set(re.findall(r"\bmod\s+(\w+)\s*;", self.text))
        #: name -> the path it re-exports (``pub use a::b::Name;``).
        self.exports: Dict[str, List[str]] = {}
        for tree in _use_trees(self.text, public=True):
            for path_, name in _expand(tree):
                if name != "*":
                    self.exports[name] = path_


def _module_of(src: Path, path: Path) -> Tuple[str, ...]:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts.pop()
    return tuple(parts)


def _use_trees(text: str, public: Optional[bool] = None) -> Iterator[str]:
    """The trees of the ``use`` items (``crate::a::{b, c::D}``); only the ``pub`` ones, or
    only the others, when ``public`` says."""
    for found in re.finditer(r"(\bpub(?:\([^)]*\))?\s+)?\buse\s+([^;]*);", text):
        if public is None or public == (found.group(1) is not None):
            tree = re.sub(r"\s+as\s+", "\0", found.group(2))
            yield re.sub(r"\s+", "", tree).replace("\0", " as ")


def _expand(tree: str) -> Iterator[Tuple[List[str], str]]:
    """A use tree's leaves: (the path's segments, the last segment or its ``as`` name)."""
    if "{" not in tree:
        path, _, alias = tree.partition(" as ")
        segments = [s for s in path.split("::") if s]
        yield segments, alias or (segments[-1] if segments else "")
        return
    head, _, rest = tree.partition("{")
    inner = rest[: rest.rindex("}")]
    depth, part, parts = 0, "", []
    for c in inner:
        if c == "," and depth == 0:
            parts.append(part)
            part = ""
            continue
        depth += (c == "{") - (c == "}")
        part += c
    parts.append(part)
    for part in filter(None, parts):
        yield from _expand(head + part)


_PATH = re.compile(r"(?<![\w:])((?:crate|super|self)(?:::\w+)+|\w+(?:::\w+)+)")


def _paths(file: RustFile) -> Iterator[List[str]]:
    """Every path the file names between its own crate's modules, as segments from the
    crate's root."""
    code = re.sub(r"(\bpub(?:\([^)]*\))?\s+)?\buse\s+[^;]*;", " ", file.text)
    raw = [segments for tree in _use_trees(file.text, False) for segments, _ in _expand(tree)]
    raw += [found.group(1).split("::") for found in _PATH.finditer(code)]
    for segments in raw:
        absolute = _absolute(file, segments)
        if absolute is not None:
            yield absolute


def _absolute(file: RustFile, segments: List[str]) -> Optional[List[str]]:
    if not segments:
        return None
    if segments[0] == "crate":
        return segments[1:]
    if segments[0] in ("self", "super"):
        module = list(file.module)
        while segments and segments[0] in ("self", "super"):
            if segments.pop(0) == "super":
                module = module[:-1]
        return module + segments
    if segments[0] in file.children:
        return list(file.module) + segments
    return None


def _resolve(
    files: Dict[Tuple[str, ...], RustFile], segments: List[str], depth: int = 0
) -> Optional[Tuple[str, ...]]:
    """The module (file) that defines what ``segments`` names: the longest module prefix,
    through the re-exports of that module when the item is one."""
    for cut in range(len(segments), -1, -1):
        module = tuple(segments[:cut])
        if module in files:
            break
    else:
        return None
    rest = segments[cut:]
    target = files[module]
    if rest and rest[0] in target.exports and depth < 8:
        again = _absolute(target, list(target.exports[rest[0]]))
        if again is not None:
            return _resolve(files, again + rest[1:], depth + 1) or module
    return module


def _rust_files(src: Path) -> Dict[Tuple[str, ...], RustFile]:
    files = {
        _module_of(src, path): RustFile(path, _module_of(src, path))
        for path in sorted(src.rglob("*.rs"))
        if path.name != "main.rs" or not (src / "lib.rs").exists()
    }
    tests = {module + (name,) for module, file in files.items() for name in file.test_modules}
    return {module: file for module, file in files.items() if module not in tests}


def _top_level(module: Tuple[str, ...]) -> Optional[str]:
    """The top-level module a file belongs to (None for the crate's root)."""
    return module[0] if module else None


def check_rust(crate: str, root: Path = ROOT, folders: Optional[bool] = None) -> List[str]:
    """Every break of the rules in ``crates/<crate>/src``, one line each; ``folders``: hold
    its top-level modules to the rule of no circle (default: when ``FOLDER_CRATES`` names
    it)."""
    src = root / "crates" / crate / "src"
    files = _rust_files(src)
    problems: List[str] = []
    edges: Dict[str, Set[str]] = {}
    tops: Dict[str, Set[str]] = {}
    for module, file in files.items():
        rel = file.path.relative_to(root)
        lines = len(file.text.splitlines()) - file.test_lines
        if lines > MAX_RUST_FILE:
            problems.append(f"{rel}: {lines} lines outside its tests (at most {MAX_RUST_FILE})")
        for name, line, length in rust_functions(file.text):
            if length > MAX_FUNCTION:
                problems.append(f"{rel}:{line}: fn {name} has {length} lines (at most 60)")
        name = str(file.path.relative_to(src))
        targets = {_resolve(files, path) for path in _paths(file)}
        edges[name] = {
            str(files[t].path.relative_to(src)) for t in targets if t is not None and t != module
        }
        top = _top_level(module)
        if top is not None:
            reached = {_top_level(t) for t in targets if t is not None}
            tops.setdefault(top, set()).update(r for r in reached if r not in (None, top))
    allowed = [members for members, _ in ALLOWED_CYCLES.get(crate, [])]
    problems += _cycle_lines(edges, allowed, f"crates/{crate}/src")
    if folders if folders is not None else crate in FOLDER_CRATES:
        problems += _cycle_lines(tops, [], f"crates/{crate}/src (top-level modules)")
    return problems


def rust_crates(root: Path = ROOT) -> List[str]:
    return sorted(path.parent.name for path in root.glob("crates/*/src"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("crates", nargs="*", help="Rust crates to check (default: every one)")
    parser.add_argument("--python-only", action="store_true", help="check python/tether only")
    args = parser.parse_args(argv)
    problems = check_python()
    if not args.python_only:
        for crate in args.crates or rust_crates():
            problems += check_rust(crate)
    for line in problems:
        print(line)
    print(f"{len(problems)} problem(s)" if problems else "the layout is clean")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
