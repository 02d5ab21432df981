"""What proves a kept dataset unchanged (``tether.pool.snapshot``), on its own: every change
pickle would see is seen, nothing it cannot prove counts as unchanged, identity is never
mistaken for an address, and big containers of plain values and big arrays cost what their
size does not."""

from __future__ import annotations

import functools
import socket
from typing import Any

import numpy as np
import pytest
import torch

from tether.pool.snapshot import WALK_NODES, Snapshot, reaches

pytestmark = pytest.mark.timeout(60)


class Holder:
    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def changed(make: Any, change: Any) -> bool:
    """Whether a snapshot of ``make()`` sees ``change`` (and saw nothing before it)."""
    obj = make()
    snapshot = Snapshot.take(obj)
    assert snapshot.proves, snapshot.why
    assert snapshot.same(obj)
    change(obj)
    return not snapshot.same(obj)


SAMPLES = lambda: [(f"/data/{i}.jpg", i % 10) for i in range(10_000)]  # noqa: E731


@pytest.mark.parametrize(
    "change",
    [
        lambda h: h.samples.append(("/data/new.jpg", 1)),
        lambda h: h.samples.__setitem__(5000, ("/data/5000.jpg", 0)),
        lambda h: h.samples.__setitem__(1, (h.samples[1][0], True)),
        lambda h: h.samples.sort(key=lambda s: -s[1]),
        lambda h: setattr(h, "samples", SAMPLES()),
    ],
    ids=["appended", "an item equal, not the same", "1 made True", "sorted", "an equal new list"],
)
def test_a_big_list_of_plain_values_is_compared_item_by_item_by_identity(change):
    # An equal new list of equal new tuples pickles alike, but what is not the same object
    # is not proven the same: it counts as a change (sent again, never stale).
    assert changed(lambda: Holder(samples=SAMPLES()), change)


def test_plain_values_equal_but_of_another_type_are_a_change():
    assert changed(lambda: Holder(x=[1, 2]), lambda h: h.x.__setitem__(0, True))
    assert changed(lambda: Holder(x=0.0), lambda h: setattr(h, "x", -0.0))
    assert changed(lambda: Holder(x={i: i for i in range(100)}), lambda h: h.x.__setitem__(5, 5.0))


def test_a_list_at_the_address_of_the_old_one_is_a_change():
    holder = Holder(items=[0, 1, 2, 3])
    snapshot = Snapshot.take(holder)
    address = id(holder.items)
    holder.items = None
    holder.items = [10, 11, 12, 13]
    assert id(holder.items) == address  # CPython gave the new list the old one's place
    assert not snapshot.same(holder)


def test_more_than_the_walk_looks_at_proves_nothing():
    big = Holder(nodes=[Holder(i=i) for i in range(WALK_NODES)])
    snapshot = Snapshot.take(big)
    assert not snapshot.proves and "more than" in snapshot.why
    assert not snapshot.same(big)


def test_what_hands_out_file_descriptors_proves_nothing():
    with socket.socket() as sock:
        assert not Snapshot.take(Holder(sock=sock)).proves


def test_reductions_are_walked_as_pickle_calls_them():
    assert changed(lambda: Holder(f=functools.partial(max, 1)), lambda h: h.f.keywords.update(a=1))
    assert changed(lambda: Holder(t=torch.zeros(3)), lambda h: h.t.add_(1))
    assert changed(lambda: Holder(a=np.zeros(8)), lambda h: h.a.__setitem__(3, 1))


def test_a_write_anywhere_in_a_big_array_is_seen_without_reading_it():
    array = np.zeros(2**21)  # 16 MiB, anonymous memory
    holder = Holder(a=array[3:-5])  # a view: its ends are partial pages
    first = Snapshot.take(holder)
    if not first.proves:
        pytest.skip(f"this kernel cannot prove memory unwritten: {first.why}")
    assert first.same(holder)
    for index in (4, 2**20, 2**21 - 6):
        array[index] += 1
        assert not first.same(holder)
        again = Snapshot.take(holder)  # protects the pages again
        assert again.same(holder) and not first.same(holder)
        first = again
    array[0] = 5  # outside the view
    assert first.same(holder)


def test_reaches_finds_an_object_at_any_depth():
    inner = Holder(x=[1])
    outer = Holder(layers=[Holder(wrapped=(Holder(deep=inner),))])
    assert reaches(outer, inner) and reaches(outer, inner.x)
    assert not reaches(outer, Holder())
