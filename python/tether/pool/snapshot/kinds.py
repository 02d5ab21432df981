"""What each kind of value contributes to a snapshot (see ``snapshot``): the tokens that
stand for it and the values to walk after it, following the order in which pickle itself
decides how to save an object:

- a function or class of ``__main__``, a lambda, or one defined inside a function travels
  by value (cloudpickle; see ``pickling``'s ``as_fork``): its code, defaults, closure,
  attributes and the globals its code names are walked; a class's members likewise;
- any other class, function or module travels by reference: compared by identity;
- a torch tensor or a numpy array: see ``data``;
- a ``tether.share`` list or dict: read-only, it travels as its memfd: by identity, in one
  token whatever its size;
- an object of a type pickle reduces with a registered function (a bound method, a
  ``functools.partial``, copyreg's table): that reduction, walked;
- a socket, a connection, a storage, or another object registered with multiprocessing's
  reductions cannot be proven (its reduction hands out fds);
- any other object: its ``__reduce_ex__(5)``, exactly what pickle calls, walked (for an
  ordinary instance: its class and its ``__dict__`` and ``__slots__`` state). An object
  pickle cannot reduce cannot be proven.

A value that cannot be proven raises ``UnprovableError``: the object holding it is sent again
with every loader."""

from __future__ import annotations

import functools
import sys
import types
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, List, Optional, Tuple

from tether.common import pickling

from . import data
from .tokens import (
    CLASS,
    EMPTY,
    ENTER,
    FUNCTION,
    UnprovableError,
    Walk,
    reduced,
)


def visit(walk: Walk, value: Any, push: Callable[[Any], None]) -> None:
    """An object that is no builtin container or atom (see the module's documentation)."""
    kind = type(value)
    if kind is types.FunctionType or isinstance(value, type):
        if pickling.travels_by_value(value, as_fork=True):
            if kind is types.FunctionType:
                return _function(walk, value, push)
            return _class(walk, value, push)
        return walk.emit_ref(value)  # by reference (pickle's save_global)
    if kind is types.ModuleType:
        return walk.emit_ref(value)
    special = _special(kind)
    if special is not None:
        return special(walk, value, push)
    try:
        reduction = value.__reduce_ex__(5)
    except Exception as exc:  # noqa: BLE001 - what pickle would fail on cannot be proven
        raise UnprovableError(f"{kind.__qualname__}.__reduce_ex__ raised {exc!r}") from None
    reduced(walk, value, reduction, push)


_SPECIAL: Dict[type, Optional[Callable[..., None]]] = {}


def _special(kind: type) -> Optional[Callable[..., None]]:
    """How pickle saves a ``kind`` when it is not by ``__reduce_ex__``: a registered
    reduction, or a kind with its own proof here."""
    try:
        return _SPECIAL[kind]
    except KeyError:
        pass
    found = _find_special(kind)
    _SPECIAL[kind] = found
    return found


def _find_special(kind: type) -> Optional[Callable[..., None]]:
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(kind, torch.Tensor):
        return data.tensor
    numpy = sys.modules.get("numpy")
    if numpy is not None and kind is numpy.ndarray:
        return data.array
    shared = sys.modules.get("tether.share.items")
    if shared is not None and issubclass(kind, shared.SHARED):
        return _shared_copy
    table = pickling.dispatch_table()
    reducer = table.get(kind)
    if reducer is None:
        return None
    registered = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    if registered.get(kind) is reducer and kind not in _PURE:
        return _unprovable
    return functools.partial(_by_reducer, reducer)


#: Types whose multiprocessing reduction hands out no fd: it only names other values.
_PURE = (
    types.MethodType,
    types.BuiltinMethodType,
    type(list.append),  # method_descriptor
    type(object.__init__),  # wrapper_descriptor
    functools.partial,
)


def _by_reducer(reducer: Callable[[Any], Any], walk: Walk, value: Any, push: Any) -> None:
    try:
        reduction = reducer(value)
    except Exception as exc:  # noqa: BLE001
        what = type(value).__qualname__
        raise UnprovableError(f"the reduction of a {what} raised {exc!r}") from None
    reduced(walk, value, reduction, push)


def _shared_copy(walk: Walk, value: Any, push: Any) -> None:
    """A ``tether.share`` list or dict: read-only, it travels as its memfd, so it is the
    same while it is the same object (compared by identity, whatever its size)."""
    walk.emit_ref(value)


def _unprovable(walk: Walk, value: Any, push: Any) -> None:
    raise UnprovableError(f"a {type(value).__qualname__} travels as a file descriptor")


# -- by value (__main__'s, lambdas, local ones: cloudpickle) ----------------------------


def _function(walk: Walk, fn: types.FunctionType, push: Callable[[Any], None]) -> None:
    """A function that travels by value: what cloudpickle takes of it."""
    code = fn.__code__
    walk.emit((ENTER, FUNCTION, 8))
    walk.emit_ref(code)
    cells = tuple(_cell(c) for c in fn.__closure__ or ())
    names = _global_names(code)
    globals_ = tuple(fn.__globals__.get(name, EMPTY) for name in names)
    for part in (fn.__name__, fn.__qualname__, fn.__defaults__, fn.__kwdefaults__):
        push(part)
    push(fn.__dict__)
    push(cells)
    push(globals_)


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return EMPTY


_NAMES: "weakref.WeakKeyDictionary[types.CodeType, Tuple[str, ...]]" = weakref.WeakKeyDictionary()


def _global_names(code: types.CodeType) -> Tuple[str, ...]:
    """The names a code object (and the code objects it holds) may read as globals."""
    names = _NAMES.get(code)
    if names is None:
        found: List[str] = []
        todo = [code]
        while todo:
            current = todo.pop()
            found.extend(current.co_names)
            todo.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
        names = tuple(dict.fromkeys(found))
        _NAMES[code] = names
    return names


def _class(walk: Walk, cls: type, push: Callable[[Any], None]) -> None:
    """A class that travels by value: its name, bases and members."""
    walk.emit((ENTER, CLASS, 4))
    members = tuple(
        (name, _member(value))
        for name, value in vars(cls).items()
        if name not in ("__dict__", "__weakref__")
    )
    for part in (cls.__name__, cls.__qualname__, cls.__bases__, members):
        push(part)


_DESCRIPTORS = (
    types.MemberDescriptorType,
    types.GetSetDescriptorType,
    types.WrapperDescriptorType,
    types.MethodDescriptorType,
    types.BuiltinFunctionType,
)


def _member(value: Any) -> Any:
    """A member of a class that travels by value, as something the walk can compare."""
    if isinstance(value, (staticmethod, classmethod)):
        return (type(value).__name__, value.__func__)
    if isinstance(value, property):
        return ("property", value.fget, value.fset, value.fdel, value.__doc__)
    if isinstance(value, _DESCRIPTORS):
        return ("descriptor", type(value).__name__, getattr(value, "__name__", None))
    return value
