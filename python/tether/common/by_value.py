"""Functions and classes that travel by value (see ``common.pickling``): which do, and how.

A function or class travels by value, pickled by cloudpickle (tether's dependency, imported
only when such an object travels), when another process could not import it by name as this
one has it: one of a ``__main__`` without a file (a notebook, the REPL, ``python -c``,
stdin), and, for what a pool's workers receive for a DataLoader (*as fork*), every one of
``__main__``, every lambda, every one defined inside a function or whose name was rebound.
Its code takes with it the values of what it reads (the globals its code names, the
variables it closes over); one of them that cannot travel is named in the error. Its code
keeps the file it was defined in (cloudpickle would name it ``<dynamic-code>``), so that a
traceback or a stack from the other process names the file and line, as fork's does."""

from __future__ import annotations

import importlib
import io
import pickle
import sys
from collections import ChainMap
from types import CodeType, FunctionType, ModuleType
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

__all__ = [
    "BY_VALUE_KINDS",
    "as_fork_class",
    "main_without_file",
    "named_global",
    "reduce",
    "travels_by_value",
]

#: What may travel by value.
BY_VALUE_KINDS = (FunctionType, type)


def travels_by_value(obj: Union[FunctionType, type], as_fork: bool) -> bool:
    """Whether a function or class travels by value: one of ``__main__`` when ``__main__``
    has no file, or (``as_fork``) whenever an import by name would not give this very
    object: ``__main__``'s, a lambda, one defined inside a function, one whose name was
    rebound (cloudpickle's rule)."""
    module = getattr(obj, "__module__", None)
    if module == "__main__":
        return as_fork or main_without_file()
    if not as_fork:
        return False
    found: Any = sys.modules.get(module) if isinstance(module, str) else None
    for part in getattr(obj, "__qualname__", "<").split("."):
        found = getattr(found, part, None)
    return found is not obj


def main_without_file() -> bool:
    """Whether this process's ``__main__`` has no file another process could import it from
    (a notebook or IPython, the REPL, ``python -c``, stdin: no ``__file__``, or a name such
    as ``<stdin>``), and is no module run with ``-m``."""
    main = sys.modules.get("__main__")
    if main is None or getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return False
    path = getattr(main, "__file__", None)
    return not isinstance(path, str) or path.startswith("<")


def _cloudpickle(obj: Any) -> ModuleType:
    """cloudpickle (installed with tether), or, where it is missing all the same, a
    PicklingError that says why ``obj`` needs it and how to get it."""
    try:
        return importlib.import_module("cloudpickle")
    except ImportError:
        if obj is None:
            what = "what a pool's workers receive for a DataLoader cannot be pickled"
        else:
            kind = "class" if isinstance(obj, type) else "function"
            what = (
                f"the {kind} {obj.__qualname__} cannot travel to another process: it is "
                "defined in a __main__ without a file (a notebook, the REPL, python -c or "
                "stdin)"
            )
        raise pickle.PicklingError(
            f"{what}: tether sends such functions and classes by value with cloudpickle, a "
            "dependency of tether missing from this environment (was tether installed with "
            "--no-deps?): pip install cloudpickle"
        ) from None


def reduce(
    obj: Union[FunctionType, type], usual: Dict[Any, Any]
) -> Tuple[Callable[[bytes], Any], Tuple[bytes]]:
    """The reduction of a function or class of a ``__main__`` without a file: cloudpickle's
    pickle of it (code, closure, the globals it uses, a class's body) with the reductions of
    ``ForkingPickler`` (so a tensor it refers to moves to shared memory, an fd travels with
    the message), unpickled where the message is. cloudpickle gives a class an id that
    follows it: the same class pickled in several messages, or sent back, is one class."""
    pickler = _by_value_pickler(_cloudpickle(obj), usual)
    buf = io.BytesIO()
    try:
        pickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception as exc:
        named = _unpicklable_global(obj, pickler)
        if named is None:
            raise
        raise named from exc
    return _from_main, (buf.getvalue(),)


def _unpicklable_global(obj: Union[FunctionType, type], pickler: type) -> Optional[Exception]:
    """A ``PicklingError`` that names what ``obj`` (a function or class that travels by
    value) reads and cannot travel: a global its code (or its methods') names, a variable
    it closes over, a class attribute. None when none of them is why it could not."""
    for what, reader, value in _what_travels_with(obj):
        if isinstance(value, (ModuleType, FunctionType, type)):
            continue  # (each is looked at in turn)
        try:
            pickler(io.BytesIO(), pickle.HIGHEST_PROTOCOL).dump(value)
        except Exception as why:  # noqa: BLE001 - the one to name
            return pickle.PicklingError(
                f"{what} (a {type(value).__qualname__}), which {reader} reads, cannot travel "
                f"to another process: {why}. A function or class that travels by value takes "
                "the values of what its code reads with it, as a fork would give them; make "
                "this one picklable, or create it in the other process (in a pool's worker: "
                "in worker_init_fn, or lazily in __getitem__)"
            )
    return None


def _what_travels_with(obj: Union[FunctionType, type]) -> Iterator[Tuple[str, str, Any]]:
    """``(what it is, who reads it, its value)`` for each value that travels with ``obj``."""
    functions: List[Any] = [obj] if isinstance(obj, FunctionType) else []
    if isinstance(obj, type):
        for name, member in vars(obj).items():
            member = getattr(member, "__func__", member)
            if isinstance(member, property):
                functions.extend((member.fget, member.fset, member.fdel))
            elif not isinstance(member, FunctionType) and not name.startswith("__"):
                yield f"the attribute {name!r} of class {obj.__qualname__}", "it", member
            functions.append(member)
    for function in functions:
        if not isinstance(function, FunctionType):
            continue
        names = function.__code__.co_freevars
        for name, cell in zip(names, function.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            yield f"the variable {name!r} it closes over", function.__qualname__, value
        for name in _code_names(function.__code__):
            if name in function.__globals__:
                what = f"the global {name!r} of {function.__module__}"
                yield what, function.__qualname__, function.__globals__[name]


def _code_names(code: Any) -> List[str]:
    """The global names a code object and the code objects it holds may read."""
    names: List[str] = []
    todo = [code]
    while todo:
        current = todo.pop()
        names.extend(current.co_names)
        todo.extend(c for c in current.co_consts if hasattr(c, "co_names"))
    return list(dict.fromkeys(names))


#: ``(ForkingPickler's table, the pickler class made with it)``.
_by_value_class: Optional[Tuple[Any, type]] = None


def _by_value_pickler(cloudpickle: ModuleType, table: Dict[Any, Any]) -> type:
    """cloudpickle's Pickler, with ``ForkingPickler``'s reductions (``table``) under its own."""
    global _by_value_class
    if _by_value_class is None or _by_value_class[0] is not table:
        base = cloudpickle.Pickler
        own = {CodeType: _code_with_its_file(base.dispatch_table[CodeType])}
        made = type(
            "_ByValuePickler",
            (base,),
            {"dispatch_table": ChainMap(own, base.dispatch_table, table)},
        )
        _by_value_class = (table, made)
    return _by_value_class[1]


def _code_with_its_file(reduce_code: Callable[[CodeType], Any]) -> Callable[[CodeType], Any]:
    """cloudpickle's reduction of a code object (``reduce_code``), but keeping the file the
    code was defined in instead of its ``<dynamic-code>``."""

    def reduce(code: CodeType) -> Any:
        make, args = reduce_code(code)
        return make, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)

    return reduce


def _from_main(data: bytes) -> Any:
    """A function or class of the sender's ``__main__``, rebuilt from cloudpickle's bytes."""
    return pickle.loads(data)


#: ``(the usual table, the as-fork pickler class made with it)``.
_as_fork: Optional[Tuple[Dict[Any, Any], type]] = None


def as_fork_class(usual: Dict[Any, Any]) -> type:
    """cloudpickle's Pickler (what cannot be imported by name as this process has it travels
    by value, in this one pickle: what several functions share stays shared) with the
    ``usual`` reductions (``ForkingPickler``'s)."""
    global _as_fork
    if _as_fork is None or _as_fork[0] is not usual:
        base = _cloudpickle(None).Pickler
        table = dict(base.dispatch_table)
        table.update(usual)
        table[CodeType] = _code_with_its_file(base.dispatch_table[CodeType])

        def reducer_override(self: Any, obj: Any) -> Any:
            if isinstance(obj, BY_VALUE_KINDS) and travels_by_value(obj, as_fork=True):
                self.by_value.append(obj)  # (named if a global of it cannot travel)
            return base.reducer_override(self, obj)

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
            base.__init__(self, *args, **kwargs)
            self.by_value = []

        members = {"dispatch_table": table, "reducer_override": reducer_override}
        _as_fork = (usual, type("_AsForkPickler", (base,), {**members, "__init__": __init__}))
    return _as_fork[1]


def named_global(objects: Sequence[Any], pickler: type) -> Optional[Exception]:
    """The error that names the global of one of ``objects`` (functions and classes that
    travelled by value) that cannot travel, if that is why a pickling failed."""
    for obj in objects:
        named = _unpicklable_global(obj, pickler)
        if named is not None:
            return named
    return None
