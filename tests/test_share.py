"""``tether.share``: a list, tuple or dict as one read-only copy in shared memory. A
``SharedList`` reads as the list it was made from, a ``SharedDict`` as the dict (in its
order, with lookups that no hash seed changes); every mutation is a TypeError that says how
to change it; the pages are mapped read-only; and the object travels as a reference to the
same pages (DataLoader workers of every start method, pool workers, executor tasks,
``tether.spawn`` ranks, queues), or as its items through plain pickle."""

from __future__ import annotations

import collections
import dataclasses
import enum
import io
import multiprocessing
import os
import pickle
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
import share_helpers as helpers
import torch
from torch.utils.data import DataLoader

import tether

pytestmark = pytest.mark.timeout(120)

ITEMS = [("a", 1), ("b", 2), ("a", 1), ("c", 3), ("d", 4), ("e", 5), ("f", 6)]


def test_a_shared_list_is_a_sequence_of_the_same_items():
    shared = tether.share(ITEMS)
    assert isinstance(shared, tether.SharedList) and isinstance(shared, Sequence)
    assert len(shared) == len(ITEMS) and bool(shared) and not tether.share([])
    assert list(shared) == ITEMS and list(reversed(shared)) == ITEMS[::-1]
    assert repr(shared) == "tether.SharedList([('a', 1), ('b', 2), ('a', 1), ... 4 more])"


@pytest.mark.parametrize("index", [0, 3, 6, -1, -7, True])
def test_an_int_index_reads_as_a_list_does(index):
    assert tether.share(ITEMS)[index] == ITEMS[index]


@pytest.mark.parametrize("index", [7, -8, 2**70])
def test_an_index_out_of_range_is_an_index_error(index):
    with pytest.raises(IndexError):
        tether.share(ITEMS)[index]


def test_a_slice_reads_as_a_list_of_the_same_items():
    shared = tether.share(ITEMS)
    for start in (None, 0, 2, -3, 10, -10):
        for stop in (None, 0, 4, -1, 10, -10):
            for step in (None, 1, 2, -1, -2, 5):
                got = shared[start:stop:step]
                assert type(got) is list and got == ITEMS[start:stop:step], (start, stop, step)
    with pytest.raises(ValueError):
        shared[::0]
    with pytest.raises(TypeError, match="SharedList indices must be integers or slices, not str"):
        shared["a"]


def test_in_index_and_count_answer_as_for_a_list():
    shared = tether.share(ITEMS)
    assert ("a", 1) in shared and ("z", 0) not in shared and 1 not in shared
    assert shared.count(("a", 1)) == 2 and shared.count(("z", 0)) == 0
    for args in [(("a", 1),), (("a", 1), 1), (("a", 1), -5), (("f", 6), 0, -1), (("c", 3), 2, 3)]:
        try:
            want = ITEMS.index(*args)
        except ValueError:
            with pytest.raises(ValueError, match="is not in SharedList"):
                shared.index(*args)
        else:
            assert shared.index(*args) == want


def test_equality_with_a_list_or_tuple_of_the_same_items():
    shared = tether.share(ITEMS)
    assert shared == ITEMS and ITEMS == shared and not shared != ITEMS
    assert shared == tether.share(list(ITEMS)) and shared == shared
    assert shared != ITEMS[:-1] and shared != [*ITEMS[:-1], ("f", 7)]
    assert shared == tuple(ITEMS) and tuple(ITEMS) == shared and shared != tuple(ITEMS[:-1])
    assert shared != "abc" and shared != None  # noqa: E711
    with pytest.raises(TypeError, match="unhashable"):
        hash(shared)


def test_a_tuple_is_shared_as_a_shared_list():
    shared = tether.share(tuple(ITEMS))
    assert isinstance(shared, tether.SharedList) and shared == ITEMS
    assert tether.share(shared) is shared and tether.SharedList(iter(ITEMS)) == ITEMS


class Color(enum.Enum):
    RED = 1


@dataclasses.dataclass(frozen=True)
class Point:
    x: int
    y: int


Pair = collections.namedtuple("Pair", "path label")


class Text(str):
    pass


def test_items_of_every_type_come_back_equal_and_of_their_own_type():
    nested = [1, [2, [3, ("x", b"y")]]]
    items = [
        "", "path/é/文件", "\udcff", 0, -1, 2**40, -(2**63), 2**200, True, False, 1.5,
        float("inf"), -0.0, None, (), ("a", 1), nested, [], b"", b"\x00\xff", {"k": [1]},
        {1, 2}, Color.RED, Point(1, 2), Pair("p", 3), Text("sub"), 1 + 2j, bytearray(b"ba"),
        (1, (2, (3, (4, ())))), ["x"] * 300, "s" * 100_000,
    ]  # fmt: skip
    shared = tether.share(items)
    for got, want in zip(shared, items):
        assert type(got) is type(want) and got == want, want
    assert shared[16] is not nested and shared[16] == nested
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    got = tether.share([array, (array, "x")])
    assert np.array_equal(got[0], array) and got[0].dtype == np.float32
    assert np.array_equal(got[1][0], array) and got[1][1] == "x"
    # A list met twice in one item stays one list, as pickle keeps it.
    inner = [1]
    again = tether.share([[inner, inner]])[0]
    assert again == [[1], [1]] and again[0] is again[1]
    assert tether.share([float("nan")])[0] != tether.share([float("nan")])[0]


def test_a_shared_dict_is_a_mapping_in_the_dicts_order():
    source = {"z": 1, "a": [2], 3: "three", (4, "four"): None}
    shared = tether.share(source)
    assert isinstance(shared, tether.SharedDict) and isinstance(shared, Mapping)
    assert len(shared) == 4 and list(shared) == list(source)
    assert list(shared.keys()) == list(source.keys())
    assert list(shared.values()) == list(source.values())
    assert list(shared.items()) == list(source.items())
    assert shared == source and source == shared and shared == tether.SharedDict(source)
    assert shared != {**source, "z": 2} and shared != {"z": 1} and shared != list(source)
    assert ("z", 1) in shared.items() and "a" in shared.keys() and [2] in shared.values()
    assert shared["a"] == [2] and shared.get("nope") is None and shared.get("nope", 5) == 5
    assert repr(tether.share({"a": 1})) == "tether.SharedDict({'a': 1})"
    assert dict(tether.SharedDict(a=1)) == {"a": 1} and len(tether.share({})) == 0


def test_keys_of_any_picklable_hashable_type_are_found_by_equal_keys():
    keys = [
        "s", b"s", 1, 2**100, -(2**70), 2.5, None, (1, "x", (2.0, b"y")), frozenset({"a", "b"}),
        Color.RED, Point(1, 2), 3 + 4j, Text("t"), "\udcff", float("inf"),
    ]  # fmt: skip
    source = {key: i for i, key in enumerate(keys)}
    shared = tether.share(source)
    for key, i in source.items():
        assert shared[key] == i and key in shared
        assert type(list(shared)[i]) is type(key)
    # Keys Python holds equal are one key, whatever their type or order.
    assert shared[1.0] == shared[True] == shared[1 + 0j] == source[1]
    assert shared[float(2**100)] == source[2**100]
    assert shared[frozenset({"b", "a"})] == shared[frozenset(["a", "b"])]
    assert shared[(1, "x", (2, b"y"))] == source[(1, "x", (2.0, b"y"))]
    assert shared["t"] == source[Text("t")] and shared[Point(1, 2)] == source[Point(1, 2)]
    assert "S" not in shared and 3 not in shared and (1, "x") not in shared
    assert tether.share({True: "t"})[1] == "t" and tether.share({0: "z"})[-0.0] == "z"


def test_a_missing_key_is_a_key_error_and_an_unhashable_one_a_type_error():
    shared = tether.share({"a": 1})
    with pytest.raises(KeyError) as error:
        shared["b"]
    assert error.value.args == ("b",)
    for key in ([1], {"a": 1}, ("a", [1])):
        with pytest.raises(TypeError, match="unhashable"):
            shared[key]
        with pytest.raises(TypeError, match="unhashable"):
            key in shared  # noqa: B015
    assert shared.get(lambda: None) is None  # hashable, but no key equals it


def test_lookups_do_not_depend_on_the_hash_seed():
    # A frozenset's items come in an order that depends on the seed (so does its pickle).
    source = {frozenset(f"k{i}" for i in range(20)): "set", "text": 1, b"b": 2, ("t", 1): 3}
    for i in range(200):
        source[f"key {i}"] = i
    shared = tether.share(source)
    code = (
        "import sys, tether._native as n\n"
        "from tether.share import items as s\n"
        "d = s.from_fd(int(sys.argv[1]))\n"
        "keys = [frozenset(f'k{i}' for i in range(20)), 'text', b'b', ('t', 1)]\n"
        "keys += [f'key {i}' for i in range(200)]\n"
        "print([d[k] for k in keys] == [d.get(k, 'missing') for k in keys], len(d), d['text'])"
    )
    fd = shared._fileno()
    for seed in ("0", "1", "2", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", code, str(fd)],
            pass_fds=[fd], env=env, capture_output=True, text=True, check=True, timeout=60,
        ).stdout  # fmt: skip
        assert out.split() == ["True", "204", "1"], (seed, out)


LIST_MUTATIONS = {
    "setitem": lambda s: s.__setitem__(0, 1),
    "delitem": lambda s: s.__delitem__(0),
    "append": lambda s: s.append(1),
    "extend": lambda s: s.extend([1]),
    "insert": lambda s: s.insert(0, 1),
    "pop": lambda s: s.pop(),
    "remove": lambda s: s.remove(("a", 1)),
    "clear": lambda s: s.clear(),
    "sort": lambda s: s.sort(),
    "reverse": lambda s: s.reverse(),
    "iadd": lambda s: s.__iadd__([1]),
    "imul": lambda s: s.__imul__(2),
}
DICT_MUTATIONS = {
    "setitem": lambda d: d.__setitem__("a", 1),
    "delitem": lambda d: d.__delitem__("a"),
    "pop": lambda d: d.pop("a"),
    "popitem": lambda d: d.popitem(),
    "clear": lambda d: d.clear(),
    "update": lambda d: d.update(b=2),
    "setdefault": lambda d: d.setdefault("c", 3),
    "ior": lambda d: d.__ior__({"b": 2}),
}


@pytest.mark.parametrize("name", LIST_MUTATIONS)
def test_a_list_mutation_is_a_type_error_that_says_how_to_change_it(name):
    shared = tether.share(ITEMS)
    with pytest.raises(TypeError, match=r"tether\.SharedList is read-only.*list\(shared\).*share"):
        LIST_MUTATIONS[name](shared)
    assert shared == ITEMS


@pytest.mark.parametrize("name", DICT_MUTATIONS)
def test_a_dict_mutation_is_a_type_error_that_says_how_to_change_it(name):
    shared = tether.share({"a": 1})
    with pytest.raises(TypeError, match=r"tether\.SharedDict is read-only.*dict\(shared\).*share"):
        DICT_MUTATIONS[name](shared)
    assert shared == {"a": 1}


def test_augmented_assignments_and_new_attributes_are_refused():
    shared = tether.share(ITEMS)
    with pytest.raises(TypeError, match="read-only"):
        shared += [1]
    with pytest.raises(TypeError, match="read-only"):
        shared[1:3] = []
    with pytest.raises(AttributeError):
        shared.extra = 1  # type: ignore[attr-defined]


def test_the_shared_pages_are_mapped_read_only_and_reading_writes_none():
    shared = tether.share(helpers.samples(50_000))
    (inode,) = helpers.mapped()
    for item in shared:
        assert item
    for _ in range(3):
        assert shared[12345] == helpers.sample(12345)
    # Mapped shared and read-only (a write would fault), and no page of it copied (a copy
    # would be an anonymous page of the mapping).
    (mapping,) = helpers.mapping_of(inode)
    assert mapping["perms"] == "r--s"
    assert mapping["Rss"] > 0 and mapping["Anonymous"] == 0


def test_other_objects_are_refused_with_what_share_takes():
    for obj in ("text", 3, {1, 2}, range(3), np.zeros(3)):
        with pytest.raises(TypeError, match="tether.share takes a list, a tuple or a dict, not"):
            tether.share(obj)
    with pytest.raises(TypeError, match="needs a key"):
        tether.share(lambda: [1])
    with pytest.raises(TypeError, match="key must be a str"):
        tether.share(lambda: [1], key=3)
    with pytest.raises(TypeError, match="takes a function that builds"):
        tether.share([1], key="k")


# -- how it travels ---------------------------------------------------------------------------


def test_plain_pickle_writes_the_items_which_load_equal_in_a_new_copy():
    shared = tether.share(helpers.samples(1000))
    data = pickle.dumps(shared)
    assert b"n00000000_999.JPEG" in data  # the items themselves
    loaded = pickle.loads(data)
    assert type(loaded) is tether.SharedList and loaded == shared
    assert len(helpers.mapped()) == 2  # a copy of its own, not the same pages
    source = {"a": [1, 2], 3: "x"}
    again = pickle.loads(pickle.dumps(tether.share(source)))
    assert type(again) is tether.SharedDict and again == source and list(again) == ["a", 3]


def test_torch_save_writes_the_items_which_torch_load_reads_back_equal():
    shared = tether.share(helpers.samples(100))
    buffer = io.BytesIO()
    torch.save({"samples": shared}, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False)["samples"] == shared
    buffer.seek(0)
    with torch.serialization.safe_globals([tether.SharedList]):
        assert torch.load(buffer)["samples"] == helpers.samples(100)


@pytest.mark.parametrize("flavour", ["multiprocessing", "torch"])
def test_a_multiprocessing_queue_carries_a_reference_to_the_same_pages(flavour):
    script = Path(__file__).resolve().parent / "scripts" / "share_queue.py"
    out = subprocess.run(
        [sys.executable, str(script), flavour],
        capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "same pages", out.stderr


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_dataloader_workers_of_every_start_method_map_the_same_pages(method):
    shared = tether.share(helpers.samples(200))
    loader = DataLoader(
        helpers.Folder(shared),
        batch_size=50,
        num_workers=2,
        multiprocessing_context=method,
        collate_fn=helpers.collate_list,
    )
    try:
        got = [item for batch in loader for item in batch]
    finally:
        if method == "forkserver":
            helpers.stop_forkserver()
    assert sorted(i for i, _, _ in got) == list(range(200))
    assert len({pid for _, pid, _ in got}) == 2
    assert {inodes for _, _, inodes in got} == {frozenset(helpers.mapped())}


def test_pool_workers_map_the_same_pages_for_a_kept_dataset_and_executor_tasks():
    shared = tether.share(helpers.samples(200))
    dataset = helpers.Folder(shared)
    with tether.Pool(2) as pool:
        context = pool.context()
        for _ in range(2):  # the second loader finds the dataset kept in the workers
            loader = DataLoader(
                dataset, batch_size=50, num_workers=2, multiprocessing_context=context,
                collate_fn=helpers.collate_list,
            )  # fmt: skip
            got = [item for batch in loader for item in batch]
            assert sorted(i for i, _, _ in got) == list(range(200))
            assert {inodes for _, _, inodes in got} == {frozenset(helpers.mapped())}
        results = list(pool.map(helpers.length_and_mapped, [shared] * 4))
    assert results == [(200, helpers.mapped())] * 4


def test_a_pool_keeps_a_dataset_that_holds_a_shared_list_and_sees_it_rebound(monkeypatch):
    # The pool proves the dataset unchanged by the shared list's identity: it never reads
    # the list's items (its plain-pickle reduction would), and sends it once.
    reduced = []
    plain = tether.SharedList.__reduce__
    monkeypatch.setattr(tether.SharedList, "__reduce__", lambda s: reduced.append(1) or plain(s))
    dataset = helpers.KeptSamples(tether.share(helpers.samples(100_000)))
    before = helpers.COUNTS["pickled"]
    with tether.Pool(2) as pool:
        context = pool.context()

        def items(n):
            loader = DataLoader(
                dataset, batch_size=None, num_workers=2, multiprocessing_context=context,
                sampler=range(n), collate_fn=helpers.collate_list,
            )  # fmt: skip
            return list(loader)

        for _ in range(3):
            got = items(8)
            assert [sample for *_, sample in got] == helpers.samples(8)
            assert {count for _, count, _, _ in got} == {1}  # unpickled once by each worker
            assert {inodes for _, _, inodes, _ in got} == {frozenset(helpers.mapped())}
        assert helpers.COUNTS["pickled"] - before == 1
        dataset.samples = tether.share(helpers.samples(10))  # a new shared list
        got = items(10)
        assert [sample for *_, sample in got] == helpers.samples(10)
        assert helpers.COUNTS["pickled"] - before == 2
        assert {inodes for _, _, inodes, _ in got} == {frozenset(helpers.mapped())}
    assert reduced == []


def test_a_pool_proves_a_shared_list_unchanged_by_its_identity_whatever_its_size():
    from tether.pool.snapshot import Snapshot

    big = helpers.KeptSamples(tether.share(helpers.samples(200_000)))
    small = helpers.KeptSamples(tether.share(helpers.samples(3)))
    snapshot = Snapshot.take(big)
    assert snapshot.proves and len(snapshot) == len(Snapshot.take(small))
    assert snapshot.same(big) and not snapshot.same(small)
    big.samples = tether.share(helpers.samples(200_000))  # equal, but another copy
    assert not snapshot.same(big)


def test_spawn_ranks_map_the_same_pages(start_method):
    shared = tether.share(helpers.samples(500))
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    tether.start_processes(
        helpers.rank_reports, args=(shared, queue), nprocs=2, start_method=start_method
    )
    reports = sorted(queue.get() for _ in range(2))
    queue.close()
    assert [rank for rank, *_ in reports] == [0, 1]
    for _, inodes, first, length in reports:
        assert inodes == helpers.mapped() and first == helpers.samples(3) and length == 500


def test_a_copy_is_the_object_itself():
    import copy

    shared = tether.share(ITEMS)
    assert copy.copy(shared) is shared and copy.deepcopy([shared])[0] is shared
    mapping = tether.share({"a": 1})
    assert copy.copy(mapping) is mapping and copy.deepcopy(mapping) is mapping


def test_it_pickles_small_for_a_process_start():
    # As a spawn child's argument: the fd travels, not the items.
    shared = tether.share(helpers.samples(10_000))
    from tether.common import pickling

    collector = pickling.FdCollector(inherit=True)
    assert len(pickling.dumps(shared, collector)) < 200
    assert collector.fds == [shared._fileno()]
