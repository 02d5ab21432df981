"""What proves that a kept object is unchanged: a *snapshot* of it as pickle sees it, and the
check that compares the object with it now.

A pool's workers keep the dataset, ``collate_fn`` and ``worker_init_fn`` a loader sent them
(see ``datasets``), and a worker keeps the pristine copy it unpickled (see ``shipment``).
Either copy is used again only when a snapshot proves that pickling the object now would
give what the copy was made from; anything it cannot prove counts as a change, and the
object is sent (or rebuilt) again.

The snapshot walks the object's graph as pickle does: the builtin containers item by item,
every other object through the reduction pickle would use (for an ordinary instance: its
class, its ``__dict__`` and ``__slots__``), depth first, and writes a *token* for each value
(``tokens``; per kind of value, ``kinds`` and ``data``):
plain atoms by exact type and value; classes, functions and modules, which travel by
reference, by identity (a weak reference: the snapshot never keeps the dataset alive); an
object met twice by its place in the walk, as pickle's memo does; a container by its
size, then its items. A container of at least ``PLAIN_MIN`` plain values
(``plain``) is one token, its shadow, compared with it in one pass over its item arrays.

The check walks the object again and compares token by token; it stops at the first
difference. Identity, never addresses: a value compared by identity is held as the object
it was (weakly, or strongly when it takes no weak reference), so an object that took a
freed one's address is a different object.

Every limit means "changed": a walk that meets more than ``WALK_NODES`` values, a type it
cannot prove (see ``kinds``), or an error (a container changed during the walk, a
reduction that raised) gives a snapshot that proves nothing."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from . import data, kinds, plain, tokens
from .tokens import (
    ARRAY,
    ATOM,
    ENTER,
    PLAIN,
    PROVEN,
    REF,
    SEEN,
    TENSOR,
    UnprovableError,
)

__all__ = ["PLAIN_MIN", "WALK_NODES", "Snapshot", "reaches"]

#: The most values one walk looks at (a big container of plain values counts as one).
WALK_NODES = 10_000
#: Containers of plain values at least this long are compared as a whole with a shadow.
PLAIN_MIN = 64
#: A container of plain values up to this long that no longer holds its shadow's very
#: objects is compared by value (what a reduction made afresh: ``random.Random``'s state).
BY_VALUE_MAX = 4096

_CONTAINERS = (list, tuple, dict, set, frozenset, bytearray)


class _ChangedError(Exception):
    """The check found a difference."""


class _FoundError(Exception):
    """The walk met the object it looked for."""


class _Walk:
    """One walk of an object graph: it records tokens (``old`` is None), or compares them
    with ``old``, or looks for ``target``."""

    def __init__(self, old: Optional[List[Any]] = None, target: Any = None) -> None:
        self.old = old
        self.pos = 0
        self.tokens: List[Tuple[Any, ...]] = []
        self.seen: Dict[int, int] = {}
        #: Every object walked, alive until the walk ends (so that no id is reused).
        self.alive: List[Any] = []
        self.target = target

    # -- what the kinds call ---------------------------------------------------------------

    @property
    def checking(self) -> bool:
        return self.old is not None

    def emit(self, token: Tuple[Any, ...]) -> None:
        if self.old is None:
            self.tokens.append(token)
        elif self.pos < len(self.old) and _same_token(self.old[self.pos], token):
            self.pos += 1
        else:
            raise _ChangedError

    def emit_ref(self, obj: Any) -> None:
        if self.old is None:
            self.tokens.append((REF, tokens.hold(obj)))
        elif self.pos < len(self.old) and _same_ref(self.old[self.pos], obj):
            self.pos += 1
        else:
            raise _ChangedError

    # -- the walk ----------------------------------------------------------------------------

    def run(self, root: Any) -> None:
        stack = [root]
        push = stack.append
        steps = 0
        while stack:
            steps += 1
            if steps > WALK_NODES:
                raise UnprovableError(f"more than {WALK_NODES} values to compare")
            self._visit(stack.pop(), push)
        if self.old is not None and self.pos != len(self.old):
            raise _ChangedError

    def _visit(self, value: Any, push: Any) -> None:
        kind = type(value)
        if kind in plain.ATOMS:
            return self.emit((ATOM, value))
        key = id(value)
        index = self.seen.get(key)
        if index is not None:
            return self.emit((SEEN, index))
        self.seen[key] = len(self.seen)
        self.alive.append(value)
        if value is self.target and self.target is not None:
            raise _FoundError
        if kind in _CONTAINERS:
            return self._container(value, kind, push)
        if kind is tokens.Fresh:
            self.emit((ENTER, list, len(value)))
            return _push_all(push, value)
        kinds.visit(self, value, push)

    def _container(self, value: Any, kind: type, push: Any) -> None:
        if kind is bytearray:
            self.emit((ENTER, bytearray, len(value)))
            return self.emit((ATOM, bytes(value)))
        if len(value) >= PLAIN_MIN and self._plain(value, kind):
            return
        self.emit((ENTER, kind, len(value)))
        if kind is dict:
            items: List[Any] = []
            for pair in value.items():
                items.extend(pair)
            return _push_all(push, items)
        _push_all(push, value)

    def _plain(self, value: Any, kind: type) -> bool:
        """A big container compared as a whole with its shadow: checking, whether the old
        token is one and still holds; recording, whether its items are all plain (then its
        token is written)."""
        if self.old is not None:
            if self.pos >= len(self.old):
                return False
            old = self.old[self.pos]
            if old[0] != PLAIN or old[1] is not kind:
                return False
            proven = old[3] is not None and old[3].unchanged(value)
            if not proven and not _same_shadow(kind, value, old[2]):
                return False
            self.pos += 1
            return True
        shadow = _shadow(kind, value)
        if shadow is None:
            return False
        proof = plain.ItemsProof.take(value) if kind is list else None
        self.tokens.append((PLAIN, kind, shadow, proof))
        return True


def _push_all(push: Any, items: Any) -> None:
    for item in reversed(list(items)):
        push(item)


def _shadow(kind: type, value: Any) -> Any:
    """What stands for a container of plain values (None when some item is not plain)."""
    if kind is dict:
        keys, values = tuple(value), tuple(value.values())
        if plain.plain_items(keys) and plain.plain_items(values):
            return keys, values
        return None
    items = tuple(value)
    if not plain.plain_items(items):
        return None
    if kind in (set, frozenset):
        return items, frozenset(map(id, items))
    return items


def _same_shadow(kind: type, value: Any, shadow: Any) -> bool:
    if _same_objects(kind, value, shadow):
        return True
    if len(value) > BY_VALUE_MAX or kind in (set, frozenset):
        return False
    # The repr of plain values tells their types and values exactly (True from 1, 1.0
    # from 1, -0.0 from 0.0); two equal values it tells apart only count as a change.
    if kind is dict:
        return repr(value) == repr(dict(zip(*shadow)))
    return repr(tuple(value)) == repr(shadow)


def _same_objects(kind: type, value: Any, shadow: Any) -> bool:
    if kind is dict:
        keys, values = shadow
        return (
            len(value) == len(keys)
            and plain.same_items(tuple(value), keys)
            and plain.same_items(tuple(value.values()), values)
        )
    if kind in (set, frozenset):
        items, ids = shadow
        return len(value) == len(items) and frozenset(map(id, value)) == ids
    return plain.same_items(value, shadow)


def _same_ref(old: Tuple[Any, ...], obj: Any) -> bool:
    return old[0] == REF and tokens.held(old[1]) is obj


def _same_token(old: Tuple[Any, ...], new: Tuple[Any, ...]) -> bool:
    tag = old[0]
    if tag != new[0]:
        return False
    if tag == ATOM:
        return tokens.same_atom(old[1], new[1])
    if tag == ENTER:
        return old[1] is new[1] and old[2] == new[2]
    if tag == SEEN:
        return bool(old[1] == new[1])
    if tag == TENSOR:
        return data.same_tensor(old, new)
    if tag == ARRAY:
        return data.same_array(old, new)
    if tag == PROVEN:
        return data.same_proven(old, new)
    return False


class Snapshot:
    """A snapshot of an object graph (see the module's documentation); ``why`` says what
    made it prove nothing, when it does."""

    __slots__ = ("_tokens", "why")

    def __init__(self, tokens: Optional[List[Tuple[Any, ...]]], why: str = "") -> None:
        self._tokens = tokens
        self.why = why

    @classmethod
    def take(cls, root: Any) -> "Snapshot":
        walk = _Walk()
        try:
            walk.run(root)
        except UnprovableError as exc:
            return cls(None, str(exc))
        except Exception as exc:  # noqa: BLE001 - a container changed meanwhile, a __reduce__
            return cls(None, f"the walk failed: {exc!r}")
        return cls(walk.tokens)

    @property
    def proves(self) -> bool:
        return self._tokens is not None

    def same(self, root: Any) -> bool:
        """Whether ``root`` is proven to pickle as it did when the snapshot was taken."""
        if self._tokens is None:
            return False
        try:
            _Walk(old=self._tokens).run(root)
        except Exception:  # noqa: BLE001 - _ChangedError, UnprovableError, or an error: not proven
            return False
        return True

    def __len__(self) -> int:
        return 0 if self._tokens is None else len(self._tokens)


def reaches(root: Any, target: Any) -> bool:
    """Whether ``target`` is part of what pickling ``root`` takes (or that cannot be told)."""
    if root is target:
        return True
    try:
        _Walk(target=target).run(root)
    except _FoundError:
        return True
    except Exception:  # noqa: BLE001 - past a limit, or an error: it may be there
        return True
    return False
