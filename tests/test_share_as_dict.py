"""A ``tether.SharedDict`` answers as the dict it was made from: keys looked up with numpy's
scalars of every width, ``bool``, a ``Decimal`` or a ``Fraction`` are found exactly when the
dict finds them; ``reversed()`` and ``|`` give what they give on the dict, ``|=`` raises the
read-only error; and a shared tuple equals the tuple. Every check runs the same operation
on the plain dict beside it."""

from __future__ import annotations

import types
from decimal import Decimal
from fractions import Fraction
from typing import Any, Dict

import numpy as np
import pytest

import tether

pytestmark = pytest.mark.timeout(60)

SOURCE: Dict[Any, str] = {
    0: "zero", 1: "one", 3: "three", 127: "int8 max", 255: "uint8 max", -5: "minus five",
    2**63 - 1: "int64 max", 2**64 - 1: "uint64 max", 2.5: "two and a half", 0.1: "a tenth",
    "s": "str", (1, 2): "pair", -(2**63): "int64 min",
}  # fmt: skip

INTEGERS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
FLOATS = [np.float16, np.float32, np.float64, np.longdouble]


def _lookup(mapping: Any, key: Any) -> Any:
    """What ``mapping[key]``, ``key in mapping`` and ``mapping.get(key)`` give (an error by
    its type)."""
    try:
        got = mapping[key]
    except Exception as error:  # noqa: BLE001 - compared, not handled
        got = type(error)
    return got, key in mapping, mapping.get(key, "missing")


def _values(kind: Any) -> list:
    """The stored keys and their neighbours that ``kind`` can hold."""
    info = np.iinfo(kind) if np.issubdtype(kind, np.integer) else None
    wanted = [0, 1, 2, 3, 127, 255, -5, 2**63 - 1, 2**64 - 1, -(2**63)]
    return [v for v in wanted if info is None or info.min <= v <= info.max]


@pytest.mark.parametrize("kind", INTEGERS, ids=lambda k: k.__name__)
def test_numpy_integers_of_every_width_find_the_int_keys_a_dict_finds(kind):
    shared = tether.share(SOURCE)
    for value in _values(kind):
        key = kind(value)
        assert _lookup(shared, key) == _lookup(SOURCE, key), repr(key)
        assert _lookup(shared, (key, 2)) == _lookup(SOURCE, (key, 2)), repr(key)


@pytest.mark.parametrize("kind", FLOATS, ids=lambda k: k.__name__)
def test_numpy_floats_of_every_width_find_the_keys_a_dict_finds(kind):
    shared = tether.share(SOURCE)
    for value in [0.0, 1.0, 3.0, 2.5, 0.1, -5.0, 0.3, float("inf")]:
        key = kind(value)
        assert _lookup(shared, key) == _lookup(SOURCE, key), repr(key)
    assert shared[np.float64(3.0)] == "three" and shared[np.int64(3)] == "three"


def test_bools_and_other_numbers_find_the_keys_a_dict_finds():
    shared = tether.share(SOURCE)
    keys = [
        True, False, np.True_, np.False_, Decimal(1), Decimal("2.5"), Decimal("0.1"),
        Fraction(5, 2), Fraction(1, 10), np.complex64(3), np.complex128(1), np.complex64(3 + 1j),
    ]  # fmt: skip
    for key in keys:
        assert _lookup(shared, key) == _lookup(SOURCE, key), repr(key)
    assert tether.share({1: "a"})[True] == {1: "a"}[True] == "a"


def test_numpy_keys_stored_are_found_by_the_python_numbers_equal_to_them():
    source = {np.int64(3): "three", np.float32(2.5): "two and a half", np.uint8(7): "seven"}
    shared = tether.share(source)
    for key in [3, 3.0, True, 2.5, 7, np.int16(7), 1]:
        assert _lookup(shared, key) == _lookup(source, key), repr(key)
    assert [type(k) for k in shared] == [type(k) for k in source]


def test_reversed_gives_the_keys_the_last_inserted_first():
    shared = tether.share(SOURCE)
    assert list(reversed(shared)) == list(reversed(SOURCE))
    assert list(reversed(tether.share({}))) == []


def test_or_gives_a_new_plain_dict_as_a_mapping_proxy_does():
    shared = tether.share(SOURCE)
    proxy = types.MappingProxyType(SOURCE)
    other = {"s": "changed", "new": 1}
    for got, want in [
        (shared | other, proxy | other),
        (other | shared, other | proxy),
        (shared | shared, SOURCE | SOURCE),
    ]:
        assert type(got) is dict and got == want and list(got) == list(want)
    with pytest.raises(TypeError):
        shared | [("a", 1)]
    mine = dict(other)
    mine |= shared  # a dict's own |= takes any mapping
    assert mine == other | SOURCE


def test_or_assign_raises_the_read_only_error_and_changes_nothing():
    shared = tether.share(SOURCE)
    before = shared
    with pytest.raises(TypeError, match=r"read-only.*d = dict\(shared\)"):
        shared |= {"new": 1}
    assert shared is before and shared == SOURCE


def test_a_shared_tuple_equals_the_tuple():
    items = (1, "two", (3.0, b"four"))
    shared = tether.share(items)
    assert shared == items and items == shared and not shared != items
    assert shared == list(items) and shared != items[:-1] and shared != (*items, 5)
    with pytest.raises(TypeError, match="unhashable"):
        hash(shared)  # a SharedList stands for a list: unhashable, as documented
