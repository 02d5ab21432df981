"""What each kind of value contributes to a snapshot (see ``_snapshot``): the tokens that
stand for it and the values to walk after it, following the order in which pickle itself
decides how to save an object:

- a function or class of a ``__main__`` without a file travels by value (cloudpickle):
  its code, defaults, closure, attributes and the globals its code names are walked; a
  class's members likewise;
- any other class, function or module travels by reference: compared by identity;
- a torch tensor: its type, dtype, device, shape, strides, offset, ``requires_grad`` and
  its storage (by identity; torch moves a storage to shared memory when it is first
  pickled, so the workers read the parent's very memory from then on). A storage not in
  shared memory is compared by torch's version counter too; a small tensor on a new
  storage, by content. Other layouts (sparse, quantized, nested) cannot be proven;
- a numpy array (of numbers, not of objects): dtype, shape, order and content (arrays up to
  ``SMALL_ARRAY`` bytes; a larger one cannot be proven unchanged cheaply, and is sent
  again);
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
import math
import sys
import types
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

from . import _pickling

# Token tags (the first item of every token).
ATOM = 0  # (ATOM, value): a plain atom, by exact type and value
REF = 1  # (REF, object or weak reference): an object pickled by reference, by identity
ENTER = 2  # (ENTER, kind, n): a container or a reduced object, n values follow
SEEN = 3  # (SEEN, index): the index-th object of this walk again (what pickle memoizes)
PLAIN = 4  # (PLAIN, kind, shadow): a big container of plain values
TENSOR = 5  # (TENSOR, facts, storage, version, content)
ARRAY = 6  # (ARRAY, facts, content)

#: Numpy arrays up to this size are compared by content.
SMALL_ARRAY = 1 << 20
#: Tensors up to this size, on a storage other than the one seen before, by content.
SMALL_TENSOR = 1 << 16


class UnprovableError(Exception):
    """The walk met a value it cannot prove unchanged."""


class Walk(Protocol):
    """What a kind needs of the walk."""

    def emit(self, token: Tuple[Any, ...]) -> None: ...

    def emit_ref(self, obj: Any) -> None: ...

    def by_value(self) -> bool: ...

    @property
    def checking(self) -> bool: ...


# Kinds of values that stand for themselves in the walk (fresh each time it asks).
REDUCED = "reduced"
FUNCTION = "function"
CLASS = "class"
#: Stands for an empty closure cell, and for a global a function names but its module lacks.
EMPTY = type("Empty", (), {"__repr__": lambda self: "<empty>"})()


def hold(obj: Any) -> Any:
    """What a snapshot keeps of an object compared by identity: a weak reference when it
    takes one (a strong one could keep the dataset alive), else the object."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return obj


def held(kept: Any) -> Any:
    return kept() if isinstance(kept, weakref.ref) else kept


def same_atom(a: Any, b: Any) -> bool:
    """Whether two plain atoms pickle alike."""
    if a is b:
        return True
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is float:
        return bool(a == b and math.copysign(1.0, a) == math.copysign(1.0, b))
    if kind is complex:
        return repr(a) == repr(b)
    return bool(a == b)


def visit(walk: Walk, value: Any, push: Callable[[Any], None]) -> None:
    """An object that is no builtin container or atom (see the module's documentation)."""
    kind = type(value)
    if kind is types.FunctionType or isinstance(value, type):
        if walk.by_value() and value.__module__ == "__main__":
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
        reduced = value.__reduce_ex__(5)
    except Exception as exc:  # noqa: BLE001 - what pickle would fail on cannot be proven
        raise UnprovableError(f"{kind.__qualname__}.__reduce_ex__ raised {exc!r}") from None
    _reduced(walk, value, reduced, push)


def _reduced(walk: Walk, value: Any, reduced: Any, push: Callable[[Any], None]) -> None:
    if isinstance(reduced, str):
        return walk.emit_ref(value)  # a global, saved by name
    if not isinstance(reduced, tuple) or not 2 <= len(reduced) <= 6:
        raise UnprovableError(f"{type(value).__qualname__} reduces to {type(reduced).__name__}")
    walk.emit((ENTER, REDUCED, len(reduced)))
    for index, part in enumerate(reduced):
        if index in (3, 4) and part is not None:
            part = Fresh(part)  # the list's or dict's items: an iterator, walked as a list
        push(part)


class Fresh(list):
    """Items a reduction gave as an iterator (a list or dict's items): made by the walk,
    so compared item by item, never as a whole."""


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
        return _tensor
    numpy = sys.modules.get("numpy")
    if numpy is not None and kind is numpy.ndarray:
        return _array
    table = _pickling.dispatch_table()
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
        reduced = reducer(value)
    except Exception as exc:  # noqa: BLE001
        what = type(value).__qualname__
        raise UnprovableError(f"the reduction of a {what} raised {exc!r}") from None
    _reduced(walk, value, reduced, push)


def _unprovable(walk: Walk, value: Any, push: Any) -> None:
    raise UnprovableError(f"a {type(value).__qualname__} travels as a file descriptor")


# -- by value (a __main__ without a file: cloudpickle) -----------------------------------------


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


# -- tensors and arrays -----------------------------------------------------------------------


def _tensor(walk: Walk, tensor: Any, push: Callable[[Any], None]) -> None:
    torch = sys.modules["torch"]
    if (
        tensor.layout is not torch.strided
        or tensor.is_quantized
        or getattr(tensor, "is_nested", False)
        or tensor.device.type == "meta"
        or (tensor.requires_grad and not tensor.is_leaf)
    ):
        raise UnprovableError(f"a tensor of layout {tensor.layout} cannot be proven unchanged")
    storage = tensor.untyped_storage()
    facts = (
        type(tensor),
        tensor.dtype,
        tensor.device,
        tuple(tensor.shape),
        tensor.stride(),
        tensor.storage_offset(),
        tensor.requires_grad,
        storage.nbytes(),
    )
    shared = storage.is_shared()
    content = None
    if storage.nbytes() <= SMALL_TENSOR and tensor.device.type == "cpu":
        # Checking, the tensor itself; else a copy of it, as it is now.
        content = tensor if walk.checking else tensor.detach().clone()
    walk.emit((TENSOR, facts, _StorageRef(storage, shared), tensor._version, content))
    state = getattr(tensor, "__dict__", None)
    push(state if state else None)


class _StorageRef:
    """A storage by identity, without keeping it alive (torch's weak reference), and
    whether it was in shared memory when seen."""

    __slots__ = ("ref", "cdata", "shared")

    def __init__(self, storage: Any, shared: bool) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self.ref = StorageWeakRef(storage)
        self.cdata = storage._cdata
        self.shared = shared

    def same(self, other: "_StorageRef") -> bool:
        return not self.ref.expired() and self.cdata == other.cdata


def same_tensor(old: Tuple[Any, ...], new: Tuple[Any, ...]) -> bool:
    """Whether a tensor still pickles as it did (see the module's documentation)."""
    _, facts, storage, version, content = old
    _, new_facts, new_storage, new_version, _ = new
    if facts != new_facts:
        return False
    if storage.same(new_storage) and (new_storage.shared or version == new_version):
        return True
    if content is None:
        return False
    torch = sys.modules["torch"]
    return new[4] is not None and bool(torch.equal(content, new[4]))


def _array(walk: Walk, array: Any, push: Callable[[Any], None]) -> None:
    if array.dtype.hasobject:
        return _reduced(walk, array, array.__reduce_ex__(5), push)
    if array.nbytes > SMALL_ARRAY:
        raise UnprovableError(
            f"a numpy array of {array.nbytes} bytes is not compared by content (over {SMALL_ARRAY})"
        )
    fortran = array.flags.f_contiguous and not array.flags.c_contiguous
    facts = (array.dtype.str, array.dtype, array.shape, fortran)
    walk.emit((ARRAY, facts, array.tobytes(order="A")))


def same_array(old: Tuple[Any, ...], new: Tuple[Any, ...]) -> bool:
    return bool(old[1] == new[1] and old[2] == new[2])
