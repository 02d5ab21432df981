"""Containers of plain values, and the proof that one still holds the very values it held.

A *plain* value is one that nothing can change: ``None``, a bool, an int, a float, a complex,
a str, a bytes (exact types, not subclasses), and a tuple or frozenset of plain values. A
big container of them (an ImageFolder's list of 1,281,167 ``(path, class)`` tuples) is
proven unchanged without looking at its items one by one: a *shadow* of it, a tuple that
holds the items it held (strong references: an item that was freed cannot be mistaken for
a new one at its address), is compared with it pointer by pointer, in one comparison of
their item arrays (``_native.same_items``: about 0.4 ms for the ImageFolder's list here,
with the GIL held, so that no thread changes the list meanwhile). The shadow costs 8 bytes
per item, and the items it holds stay alive while it does. Telling whether a list's items
are plain takes one look at each (``_native.plain_items``: about 30 ms for that list).

A big list's item array is also proven unwritten (``prove_items``, as a big numpy array's
memory is): while the list keeps that array, of that length, and no page of it was written,
it holds the shadow's very items without a comparison (a few microseconds, whatever its
length); anything else falls back to the comparison."""

from __future__ import annotations

import itertools
import operator
from typing import Any, Optional, Tuple

from tether import _native

from . import data

__all__ = ["ATOMS", "PROOF_MIN", "ItemsProof", "is_plain", "plain_items", "same_items"]

#: Lists of at least this many items have their item array under proof (it spans whole pages).
PROOF_MIN = 4096

#: The types of the plain values that are not containers (exact types).
ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})
_NESTING = frozenset({tuple, frozenset})


def is_plain(value: Any) -> bool:
    """Whether ``value`` is plain (see the module's documentation)."""
    kind = type(value)
    if kind in ATOMS:
        return True
    return kind in _NESTING and plain_items(value)


def plain_items(items: Any) -> bool:
    """Whether every item of ``items`` (a list, a tuple, a frozenset, a dict's keys or
    values) is plain."""
    native = _native.plain_items(items)
    if native is not None:
        return native
    level: Any = items
    while True:  # one pass per level of nesting, at C speed
        kinds = set(map(type, level))
        if kinds <= ATOMS:
            return True
        if not kinds <= ATOMS | _NESTING:
            return False
        level = list(
            itertools.chain.from_iterable(item for item in level if type(item) in _NESTING)
        )


def same_items(current: Any, shadow: Tuple[Any, ...]) -> bool:
    """Whether the list or tuple ``current`` holds exactly the objects of ``shadow``, in
    order (identity, not equality)."""
    if type(current) in (list, tuple):
        return _native.same_items(current, shadow)
    return len(current) == len(shadow) and all(map(operator.is_, current, shadow))


class ItemsProof:
    """A proof that a list's item array was not written since it was taken (see the
    module's documentation)."""

    __slots__ = ("span", "proof", "edges")

    def __init__(self, span: Tuple[int, int], proof: Any, edges: bytes) -> None:
        self.span, self.proof, self.edges = span, proof, edges

    @classmethod
    def take(cls, items: Any) -> Optional["ItemsProof"]:
        """A proof over the list ``items`` (None where its memory cannot be proven)."""
        span = _native.item_array(items)
        if span is None or len(items) < PROOF_MIN:
            return None
        proof, edges = data.start_proof(*span)
        return None if proof is None else cls(span, proof, edges)

    def unchanged(self, items: Any) -> bool:
        """Whether ``items`` still has the array under proof, unwritten."""
        return _native.item_array(items) == self.span and data.unwritten(
            self.span, self.proof, self.edges
        )
