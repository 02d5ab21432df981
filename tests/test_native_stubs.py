"""``_native.pyi`` describes the compiled module exactly: the same functions, classes and
methods, no more and no fewer."""

from __future__ import annotations

import ast
from pathlib import Path

import tether
from tether import _native

STUBS = Path(tether.__file__).parent / "_native.pyi"


def _stub_names():
    tree = ast.parse(STUBS.read_text())
    names = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names[node.name] = None
        elif isinstance(node, ast.ClassDef):
            names[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = None
    return names


def test_stubs_match_the_compiled_module():
    stubs = _stub_names()
    public = {n for n in dir(_native) if not n.startswith("_") or n == "__version__"}
    assert set(stubs) == public
    for name, methods in stubs.items():
        if methods is None:
            continue
        cls = getattr(_native, name)
        compiled = {m for m in vars(cls) if not m.startswith("_") or m in ("__init__", "__len__")}
        stubbed = {m for m in methods if not m.startswith("_") or m in ("__init__", "__len__")}
        # pyo3 classes get __init__ from #[new]; compare the rest exactly.
        assert stubbed - {"__init__"} == compiled - {"__init__"}, name
