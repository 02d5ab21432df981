"""The vocabulary of a snapshot (see ``snapshot``): its tokens, what a kind of value needs of
the walk (``Walk``), and what every kind shares: how an object compared by identity is
held, how plain atoms compare, how a reduction (what ``__reduce_ex__`` returns) is
walked."""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Protocol, Tuple

# Token tags (the first item of every token).
ATOM = 0  # (ATOM, value): a plain atom, by exact type and value
REF = 1  # (REF, object or weak reference): an object pickled by reference, by identity
ENTER = 2  # (ENTER, kind, n): a container or a reduced object, n values follow
SEEN = 3  # (SEEN, index): the index-th object of this walk again (what pickle memoizes)
PLAIN = 4  # (PLAIN, kind, shadow, proof or None): a big container of plain values
TENSOR = 5  # (TENSOR, facts, storage, content)
ARRAY = 6  # (ARRAY, facts, content)
PROVEN = 7  # (PROVEN, facts, array, bounds, proof, edges): a big array, its memory under proof


class UnprovableError(Exception):
    """The walk met a value it cannot prove unchanged."""


class Walk(Protocol):
    """What a kind needs of the walk."""

    def emit(self, token: Tuple[Any, ...]) -> None: ...

    def emit_ref(self, obj: Any) -> None: ...

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


def reduced(walk: Walk, value: Any, reduced: Any, push: Callable[[Any], None]) -> None:
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
