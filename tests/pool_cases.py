"""The cases of the differential harness (``test_pool_versus_fork.py``): datasets whose every
item tells their whole state, and what the parent (or a worker) changes between loaders.

Each case builds a fresh dataset, iterates a few loaders over it (one per epoch) and, before
each loader but the first, changes it: the pool's loaders must give every batch torch's
fork workers give. The datasets live here, importable by the pool's workers."""

from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
from torch.utils.data import (
    ChainDataset,
    ConcatDataset,
    Dataset,
    IterableDataset,
    Subset,
    SubsetRandomSampler,
    get_worker_info,
)

# -- what an item tells ------------------------------------------------------------------------


def canon(value: Any, seen: Optional[set] = None) -> str:
    """A text that tells a value's whole state, alike in every process (sets sorted, no
    addresses)."""
    seen = set() if seen is None else seen
    if isinstance(value, (type(None), bool, int, float, complex, str, bytes)):
        return repr(value)
    if id(value) in seen:
        return "<again>"
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        value = value.numpy()
    if isinstance(value, np.ndarray):
        return f"array{value.dtype}{value.shape}:{zlib.crc32(value.tobytes())}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}[{','.join(canon(v, seen) for v in value)}]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{canon(k, seen)}:{canon(v, seen)}" for k, v in value.items()) + "}"
    if isinstance(value, (set, frozenset)):
        return "set" + str(sorted(canon(v, seen) for v in value))
    if callable(value) and not hasattr(value, "__dict__") and not hasattr(value, "__slots__"):
        return getattr(value, "__qualname__", type(value).__name__)
    state = list(getattr(value, "__dict__", {}).items())
    for name in getattr(type(value), "__slots__", ()):
        state.append((name, getattr(value, name, "<unset>")))
    return f"{type(value).__name__}(" + ",".join(f"{k}={canon(v, seen)}" for k, v in state) + ")"


def code(value: Any) -> int:
    return zlib.crc32(canon(value).encode())


# -- objects a dataset holds -------------------------------------------------------------------


class Node:
    """A link of a chain: a value, and the next link."""

    def __init__(self, value: Any, child: Optional["Node"] = None) -> None:
        self.value = value
        self.child = child


def chain(depth: int, value: Any) -> Node:
    """``depth`` links; the last holds ``value``."""
    node = Node(value)
    for _ in range(depth - 1):
        node = Node(0, node)
    return node


def link(root: Node, depth: int) -> Node:
    node = root
    for _ in range(depth - 1):
        assert node.child is not None
        node = node.child
    return node


class Bag:
    """An object that holds whatever attributes it is given."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


class Shift:
    """A transform with one parameter."""

    def __init__(self, by: int) -> None:
        self.by = by

    def __call__(self, x: int) -> int:
        return x + self.by


class SlotScale:
    """A transform with ``__slots__``."""

    __slots__ = ("factor", "extra")

    def __init__(self, factor: int) -> None:
        self.factor = factor
        self.extra = [1]

    def __call__(self, x: int) -> int:
        return x * self.factor + sum(self.extra)


class Compose:
    """torchvision's Compose: a list of transforms."""

    def __init__(self, transforms: List[Any]) -> None:
        self.transforms = transforms

    def __call__(self, x: int) -> int:
        for t in self.transforms:
            x = t(x)
        return x


class Gated:
    """A value behind a property."""

    def __init__(self) -> None:
        self._level = 1

    @property
    def level(self) -> int:
        return self._level

    @level.setter
    def level(self, value: int) -> None:
        self._level = value


class Derived:
    """State rebuilt in ``__setstate__`` from what is pickled (its total is not)."""

    def __init__(self, numbers: List[int]) -> None:
        self.numbers = numbers
        self.total = sum(numbers)

    def __getstate__(self) -> Dict[str, Any]:
        return {"numbers": self.numbers}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.numbers = state["numbers"]
        self.total = sum(self.numbers)

    def add(self, number: int) -> None:
        self.numbers.append(number)
        self.total = sum(self.numbers)


# -- datasets ----------------------------------------------------------------------------------


class Graph(Dataset):
    """Item i: ``[i, the code of the whole dataset's state, a transform of i]``."""

    def __init__(self, root: Any, n: int = 6, transform: Any = None) -> None:
        self.root = root
        self.n = n
        self.transform = transform

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        x = i if self.transform is None else self.transform(i)
        if isinstance(self.root, Derived):
            x += self.root.total
        return torch.tensor([i, code(self), x], dtype=torch.int64)


class Counting(Graph):
    """A Graph whose ``__getitem__`` writes to the worker's copy (a cache, a counter)."""

    def __getitem__(self, i: int) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        return torch.tensor([i, code(self), self.calls], dtype=torch.int64)


class Scribble(Graph):
    """A Graph whose ``__getitem__`` writes into the big array it holds."""

    def __getitem__(self, i: int) -> torch.Tensor:
        self.root.value[i * 1000] += 1
        return torch.tensor([i, code(self), int(self.root.value.sum())], dtype=torch.int64)


class Offset(Graph):
    """A Graph whose ``worker_init_fn`` (``add_offset``) writes to the worker's copy."""

    def __init__(self, root: Any, n: int = 6) -> None:
        super().__init__(root, n)
        self.offset = 0

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, code(self), self.offset], dtype=torch.int64)


def add_offset(worker_id: int) -> None:
    info = get_worker_info()
    info.dataset.offset += 100 + worker_id


class Range(IterableDataset):
    """torch's documented example: ``start`` to ``end``, split between the workers by
    ``shard`` (its ``worker_init_fn``), or by ``__iter__`` itself with ``split``."""

    def __init__(self, start: int, end: int, split: bool = False, root: Any = None) -> None:
        self.start = start
        self.end = end
        self.split = split
        self.root = root
        self.seen: List[int] = []

    def __iter__(self) -> Any:
        lo, hi, step = self.start, self.end, 1
        info = get_worker_info()
        if self.split and info is not None:
            lo, step = self.start + info.id, info.num_workers
        for v in range(lo, hi, step):
            self.seen.append(v)  # the worker's copy changes as it iterates
            yield torch.tensor([v, code(self.root), len(self.seen)], dtype=torch.int64)


def shard(worker_id: int) -> None:
    """torch's documented ``worker_init_fn`` for ``Range``: each worker keeps its part."""
    info = get_worker_info()
    dataset = info.dataset
    overall_start, overall_end = dataset.start, dataset.end
    per_worker = int(math.ceil((overall_end - overall_start) / float(info.num_workers)))
    dataset.start = overall_start + info.id * per_worker
    dataset.end = min(dataset.start + per_worker, overall_end)


def shard_chain(worker_id: int) -> None:
    """``shard`` for each Range of a ChainDataset."""
    info = get_worker_info()
    for dataset in info.dataset.datasets:
        per_worker = int(math.ceil((dataset.end - dataset.start) / float(info.num_workers)))
        dataset.start = dataset.start + info.id * per_worker
        dataset.end = min(dataset.start + per_worker, dataset.end)


class Items(Dataset):
    """Item i: ``items[i]``."""

    def __init__(self, items: Any) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


class Reread(Dataset):
    """Reads its file whenever it is made or unpickled (its ``__setstate__``): item i is
    the file's text."""

    def __init__(self, path: str, n: int = 2) -> None:
        self.path = path
        self.n = n
        self.text = self._read()

    def _read(self) -> str:
        with open(self.path) as f:
            return f.read()

    def __getstate__(self) -> Dict[str, Any]:
        return {"path": self.path, "n": self.n}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.text = self._read()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> str:
        return self.text


class Views(Dataset):
    """Item i: a 16 KiB view of one 64 MiB tensor the worker made (the ``batch_size=None``
    token-shard pattern)."""

    SIZE = 64 * 2**20

    def __init__(self) -> None:
        self.big: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.big is None:
            self.big = torch.arange(self.SIZE // 4, dtype=torch.float32)
        return self.big[i * 4096 : (i + 1) * 4096]


def tensor_or_lock(i: int) -> Any:
    """Task of the executor tests: a tensor, but a lock (which does not pickle) for 3."""
    if i == 3:
        import threading

        return threading.Lock()
    return torch.full((4,), float(i))


# -- cases -------------------------------------------------------------------------------------

Change = Callable[[Any, int, Callable[[Any], None]], None]


@dataclass
class Case:
    """A dataset, how each loader over it is made, and what changes before each loader
    but the first (``change(dataset, epoch, refresh)``; ``refresh`` is the pool's, or does
    nothing for fork)."""

    name: str
    build: Callable[[], Any]
    change: Change
    loader: Dict[str, Any] = field(default_factory=dict)
    keep: bool = True
    epochs: int = 3
    #: Loader arguments made from the dataset (a sampler over it).
    per_loader: Optional[Callable[[Any, int], Dict[str, Any]]] = None
    family: str = ""


def _rebind(attr: str, make: Callable[[int], Any]) -> Change:
    def change(obj: Any, epoch: int, refresh: Any) -> None:
        setattr(obj, attr, make(epoch))

    return change


def _none_then(attr: str, make: Callable[[int], Any]) -> Change:
    def change(obj: Any, epoch: int, refresh: Any) -> None:
        setattr(obj, attr, None)
        setattr(obj, attr, make(epoch))  # often at the freed list's very address

    return change


def _twice(attr: str, make: Callable[[int], Any]) -> Change:
    def change(obj: Any, epoch: int, refresh: Any) -> None:
        setattr(obj, attr, make(epoch + 50))
        setattr(obj, attr, make(epoch))

    return change


def _in_place(attr: str, how: Callable[[Any, int], None]) -> Change:
    def change(obj: Any, epoch: int, refresh: Any) -> None:
        how(getattr(obj, attr), epoch)

    return change


#: (name, the value a link holds, the change of the link) for the depth family.
LINK_CHANGES: List[Any] = [
    ("int rebound", lambda: 1, _rebind("value", lambda e: e * 7)),
    ("str rebound", lambda: "a", _rebind("value", lambda e: "b" * e)),
    ("list rebound", lambda: [1, 2], _rebind("value", lambda e: [e, e])),
    ("None then a new list", lambda: [0, 1, 2, 3], _none_then("value", lambda e: [e] * 4)),
    ("two rebinds", lambda: [5, 6], _twice("value", lambda e: [e * 100, e * 200])),
    ("list appended", lambda: [1], _in_place("value", lambda v, e: v.append(e))),
    ("list item set", lambda: [1, 2, 3], _in_place("value", lambda v, e: v.__setitem__(1, e))),
    ("dict item set", lambda: {"a": 1}, _in_place("value", lambda v, e: v.__setitem__("b", e))),
    ("tuple rebound", lambda: (1, 2), _rebind("value", lambda e: (1, e))),
    ("tuple's list appended", lambda: ([1],), _in_place("value", lambda v, e: v[0].append(e))),
]


def _at_depth(depth: int, change: Change) -> Change:
    def at(ds: Any, epoch: int, refresh: Any) -> None:
        change(link(ds.root, depth), epoch, refresh)

    return at


def depth_cases() -> List[Case]:
    cases = []
    for depth in range(1, 8):
        for name, value, change in LINK_CHANGES:
            cases.append(
                Case(
                    f"depth {depth}: {name}",
                    lambda depth=depth, value=value: Graph(chain(depth, value())),
                    _at_depth(depth, change),
                )
            )
    return cases


def _top(attr: str, change: Change) -> Change:
    """``change`` applied to ``ds.root`` (a Node) under ``attr``."""

    def at(ds: Any, epoch: int, refresh: Any) -> None:
        change(ds.root, epoch, refresh)

    return at


#: Containers a dataset holds, small and big (a big one of plain values is compared as a
#: whole), and what is done to them in place.
CONTAINERS: List[Any] = [
    ("5 ints", lambda: list(range(5))),
    ("200 ints", lambda: list(range(200))),
    ("100 (str, int) tuples", lambda: [(f"/data/{i}.jpg", i % 7) for i in range(100)]),
    ("3 lists", lambda: [[1], [2], [3]]),
]
LIST_OPS: List[Any] = [
    ("appended", lambda v, e: v.append(v[0])),
    ("item set", lambda v, e: v.__setitem__(2, v[0])),
    ("item deleted", lambda v, e: v.__delitem__(1)),
    ("extended", lambda v, e: v.extend(v[:2])),
    ("reversed", lambda v, e: v.reverse()),
    ("inner changed", lambda v, e: v[-1].append(e) if isinstance(v[-1], list) else v.pop()),
]
DICTS: List[Any] = [
    ("small dict", lambda: {"a": 1, "b": 2}),
    ("100-key dict", lambda: {f"k{i}": i for i in range(100)}),
    ("dict of lists", lambda: {"a": [1], "b": [2]}),
]
DICT_OPS: List[Any] = [
    ("key set", lambda d, e: d.__setitem__("new", e)),
    ("value replaced", lambda d, e: d.__setitem__(next(iter(d)), -e)),
    ("key popped", lambda d, e: d.pop(next(iter(d)))),
    ("updated", lambda d, e: d.update({"z": e, "a": e})),
]


def container_cases() -> List[Case]:
    cases = []
    for (kind, make), (op, how) in itertools.product(CONTAINERS, LIST_OPS):
        cases.append(
            Case(
                f"a list of {kind}: {op}",
                lambda make=make: Graph(Node(make())),
                _top("value", _in_place("value", how)),
            )
        )
    for (kind, make), (op, how) in itertools.product(DICTS, DICT_OPS):
        cases.append(
            Case(
                f"a {kind}: {op}",
                lambda make=make: Graph(Node(make())),
                _top("value", _in_place("value", how)),
            )
        )
    for kind, make in CONTAINERS + DICTS:
        cases.append(
            Case(
                f"a {kind}: None, then a new one of the same size",
                lambda make=make: Graph(Node(make())),
                _top("value", _none_then("value", lambda e, make=make: _changed_copy(make(), e))),
            )
        )
        cases.append(
            Case(
                f"a {kind}: rebound to an equal new one",
                lambda make=make: Graph(Node(make())),
                _top("value", _rebind("value", lambda e, make=make: make())),
            )
        )
    return cases


def _changed_copy(value: Any, epoch: int) -> Any:
    if isinstance(value, dict):
        return {k: epoch for k in value}
    return [epoch] * len(value)


def _on(path: Callable[[Any], Any], how: Callable[[Any, int], None]) -> Change:
    def change(ds: Any, epoch: int, refresh: Any) -> None:
        how(path(ds), epoch)

    return change


def _set(name: str, value: Callable[[int], Any]) -> Callable[[Any, int], None]:
    return lambda obj, e: setattr(obj, name, value(e))


def object_cases() -> List[Case]:
    compose = lambda: Graph(None, transform=Compose([Shift(1), SlotScale(2), Shift(3)]))  # noqa: E731
    transforms: Callable[[Any], Any] = lambda ds: ds.transform.transforms  # noqa: E731
    gated = lambda: Graph(Gated())  # noqa: E731
    import random

    table: List[Any] = [
        (
            "a __slots__ transform's factor set",
            compose,
            _on(lambda ds: ds.transform.transforms[1], _set("factor", lambda e: e + 5)),
        ),
        (
            "a __slots__ transform's list appended",
            compose,
            _on(lambda ds: ds.transform.transforms[1].extra, lambda v, e: v.append(e)),
        ),
        (
            "a transform in a list changed",
            compose,
            _on(lambda ds: ds.transform.transforms[0], _set("by", lambda e: e * 10)),
        ),
        (
            "a transform appended to the list",
            compose,
            _on(transforms, lambda v, e: v.append(Shift(e))),
        ),
        (
            "a transform replaced in the list",
            compose,
            _on(transforms, lambda v, e: v.__setitem__(2, Shift(-e))),
        ),
        (
            "the transforms list rebound",
            compose,
            _on(lambda ds: ds.transform, _set("transforms", lambda e: [Shift(e)])),
        ),
        ("a property set", gated, _on(lambda ds: ds.root, _set("level", lambda e: e * 3))),
        (
            "state derived in __setstate__",
            lambda: Graph(Derived([1, 2, 3])),
            _on(lambda ds: ds.root, lambda d, e: d.add(e)),
        ),
        (
            "a tensor changed in place",
            lambda: Graph(Node(torch.zeros(3))),
            _on(lambda ds: ds.root.value, lambda t, e: t.add_(e)),
        ),
        (
            "a tensor set to a new storage",
            lambda: Graph(Node(torch.zeros(3))),
            _on(lambda ds: ds.root.value, lambda t, e: t.set_(torch.full((4,), float(e)))),
        ),
        (
            "a tensor rebound",
            lambda: Graph(Node(torch.zeros(3))),
            _on(lambda ds: ds.root, _set("value", lambda e: torch.full((3,), float(e)))),
        ),
        (
            "a big tensor changed in place",
            lambda: Graph(Node(torch.zeros(40000))),
            _on(lambda ds: ds.root.value, lambda t, e: t[:5].add_(e)),
        ),
        (
            "a numpy array changed in place",
            lambda: Graph(Node(np.zeros(4))),
            _on(lambda ds: ds.root.value, lambda a, e: a.__setitem__(1, e)),
        ),
        (
            "a 2 MiB numpy array changed in place",
            lambda: Graph(Node(np.zeros(2**18))),
            _on(lambda ds: ds.root.value, lambda a, e: a.__setitem__(100_000, e)),
        ),
        (
            "a 2 MiB numpy array's first byte changed",
            lambda: Graph(Node(np.zeros(2**18))),
            _on(lambda ds: ds.root.value, lambda a, e: a.__setitem__(0, e)),
        ),
        (
            "a view of a 2 MiB numpy array changed through its base",
            lambda: Graph(Node(np.zeros(2**18)[7:-9])),
            _on(lambda ds: ds.root.value.base, lambda a, e: a.__setitem__(-10, e)),
        ),
        (
            "a numpy array rebound",
            lambda: Graph(Node(np.zeros(4))),
            _on(lambda ds: ds.root, _set("value", lambda e: np.full(4, e))),
        ),
        (
            "a random.Random drawn from",
            lambda: Graph(Node(random.Random(3))),
            _on(lambda ds: ds.root.value, lambda r, e: r.random()),
        ),
        (
            "a set changed",
            lambda: Graph(Node({1, 2})),
            _on(lambda ds: ds.root.value, lambda s, e: s.add(e + 10)),
        ),
        (
            "an attribute of an object in a node set",
            lambda: Graph(Node(Shift(1))),
            _on(lambda ds: ds.root.value, _set("by", lambda e: e)),
        ),
        (
            "an attribute deleted",
            lambda: Graph(Node(Shift(1))),
            _on(lambda ds: ds.root.value, lambda obj, e: delattr(obj, "by")),
        ),
    ]
    return [Case(name, build, change) for name, build, change in table]


def _member(i: int) -> Callable[[Any], Any]:
    return lambda ds: ds.datasets[i]


def wrapper_cases() -> List[Case]:
    concat = lambda: ConcatDataset([Graph(Node(1), 3), Graph(Node([2]), 4)])  # noqa: E731
    subset = lambda: Subset(Graph(Node([1]), 10), [0, 2, 4, 6])  # noqa: E731
    chained = lambda: ChainDataset([Range(0, 4, split=True), Range(10, 13, split=True)])  # noqa: E731
    table: List[Any] = [
        (
            "ConcatDataset: a member's attribute rebound",
            concat,
            _on(lambda ds: ds.datasets[0].root, _set("value", lambda e: e)),
        ),
        (
            "ConcatDataset: a member's list appended",
            concat,
            _on(lambda ds: ds.datasets[1].root.value, lambda v, e: v.append(e)),
        ),
        (
            "ConcatDataset: a member replaced by one as long",
            concat,
            _on(lambda ds: ds.datasets, lambda v, e: v.__setitem__(0, Graph(Node(e), 3))),
        ),
        (
            "Subset: its indices changed in place",
            subset,
            _on(lambda ds: ds.indices, lambda v, e: v.__setitem__(1, e)),
        ),
        (
            "Subset: its dataset's list changed",
            subset,
            _on(lambda ds: ds.dataset.root.value, lambda v, e: v.append(e)),
        ),
        (
            "Subset: its dataset rebound",
            subset,
            _on(lambda ds: ds, _set("dataset", lambda e: Graph(Node(e), 10))),
        ),
        (
            "ChainDataset: a member's range changed",
            chained,
            _on(lambda ds: ds.datasets[1], _set("end", lambda e: 13 + e)),
        ),
        (
            "ChainDataset: a member's root set",
            chained,
            _on(lambda ds: ds.datasets[0], _set("root", lambda e: [e])),
        ),
        (
            "Subset of a ConcatDataset: a member's attribute",
            lambda: Subset(concat(), [0, 3, 5]),
            _on(lambda ds: ds.dataset.datasets[1].root, _set("value", lambda e: e)),
        ),
    ]
    return [Case(name, build, change) for name, build, change in table]


def _sampler(ds: Any, epoch: int) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(epoch)
    return {"sampler": SubsetRandomSampler(ds.picks, generator=g)}


def sampler_cases() -> List[Case]:
    def build() -> Any:
        ds = Graph(Node([1]), 8)
        ds.picks = [0, 1, 2, 3]
        return ds

    return [
        Case(
            "a sampler's indices changed in place",
            build,
            _on(lambda ds: ds.picks, lambda v, e: v.append(4 + e)),
            per_loader=_sampler,
        ),
        Case(
            "a sampler, the dataset changed too",
            build,
            _on(lambda ds: ds.root.value, lambda v, e: v.append(e)),
            per_loader=_sampler,
        ),
        Case(
            "a list of indices as the sampler",
            lambda: Graph(Node(0), 8),
            _on(lambda ds: ds.root, _set("value", lambda e: e)),
            per_loader=lambda ds, e: {"sampler": [7, 1, e, 3]},
        ),
    ]


def _nothing(ds: Any, epoch: int, refresh: Any) -> None:
    """The parent changes nothing (the worker does)."""


def worker_cases() -> List[Case]:
    table: List[Any] = [
        (
            "IterableDataset sharded in worker_init_fn",
            lambda: Range(3, 20),
            _nothing,
            {"worker_init_fn": shard},
        ),
        (
            "IterableDataset sharded in worker_init_fn, the range changed",
            lambda: Range(3, 20),
            _on(lambda ds: ds, _set("end", lambda e: 20 + 3 * e)),
            {"worker_init_fn": shard},
        ),
        (
            "IterableDataset split in __iter__, which writes to the copy",
            lambda: Range(0, 9, split=True),
            _nothing,
            {},
        ),
        (
            "ChainDataset sharded in worker_init_fn",
            lambda: ChainDataset([Range(0, 7), Range(100, 105)]),
            _nothing,
            {"worker_init_fn": shard_chain},
        ),
        ("__getitem__ writes to the copy", lambda: Counting(Node(1)), _nothing, {}),
        (
            "__getitem__ writes to the copy, the parent changes it too",
            lambda: Counting(Node(1)),
            _on(lambda ds: ds.root, _set("value", lambda e: e)),
            {},
        ),
        (
            "__getitem__ writes into a 2 MiB numpy array",
            lambda: Scribble(Node(np.zeros(2**18))),
            _nothing,
            {},
        ),
        (
            "worker_init_fn writes to the copy",
            lambda: Offset(Node(1)),
            _nothing,
            {"worker_init_fn": add_offset},
        ),
        (
            "worker_init_fn writes to a Subset's dataset",
            lambda: Subset(Offset(Node(1), 8), [1, 3, 5, 7]),
            _nothing,
            {"worker_init_fn": _subset_offset},
        ),
    ]
    return [Case(name, build, change, loader=dict(loader)) for name, build, change, loader in table]


def _subset_offset(worker_id: int) -> None:
    get_worker_info().dataset.dataset.offset += 7


def _refresh_of(path: Callable[[Any], Any], how: Callable[[Any, int], None]) -> Change:
    def change(ds: Any, epoch: int, refresh: Any) -> None:
        target = path(ds)
        how(target, epoch)
        refresh(target)

    return change


def refresh_cases() -> List[Case]:
    concat = lambda: ConcatDataset([Graph(Derived([1]), 3), Graph(Node(2), 3)])  # noqa: E731
    table: List[Any] = [
        (
            "refresh of a Subset's dataset",
            lambda: Subset(Graph(Derived([1]), 6), [0, 5]),
            _refresh_of(lambda ds: ds.dataset.root, lambda d, e: d.add(e)),
        ),
        (
            "refresh of a ConcatDataset's member",
            concat,
            _refresh_of(lambda ds: ds.datasets[0], lambda d, e: d.root.add(e)),
        ),
        (
            "refresh of a list deep in a ConcatDataset",
            lambda: ConcatDataset([Graph(Node(2), 3), Graph(Node([1]), 3)]),
            _refresh_of(lambda ds: ds.datasets[1].root.value, lambda v, e: v.append(e)),
        ),
        (
            "refresh of a transform in a list",
            lambda: Graph(None, transform=Compose([Shift(1)])),
            _refresh_of(lambda ds: ds.transform.transforms[0], _set("by", lambda e: e)),
        ),
    ]
    return [Case(name, build, change) for name, build, change in table]


#: How each case's loaders are made, in turn: workers, batch size.
LOADERS = [
    {"num_workers": 2, "batch_size": 2},
    {"num_workers": 1, "batch_size": 3},
    {"num_workers": 1, "batch_size": None},
    {"num_workers": 2, "batch_size": 1, "shuffle": True},
]


def all_cases() -> List[Case]:
    """Every case: each family, with loaders made in turn as ``LOADERS`` says, and every
    fourth case again with ``keep_datasets=False``."""
    cases: List[Case] = []
    families = {
        "depths": depth_cases(),
        "containers": container_cases(),
        "objects": object_cases(),
        "wrappers": wrapper_cases(),
        "samplers": sampler_cases(),
        "worker changes": worker_cases(),
        "refresh": refresh_cases(),
    }
    for family, members in families.items():
        for case in members:
            loader = dict(LOADERS[len(cases) % len(LOADERS)])
            loader.update(case.loader)
            if case.per_loader is not None or isinstance(case.build(), IterableDataset):
                loader.pop("shuffle", None)
            case.loader, case.family = loader, family
            cases.append(case)
    for case in list(cases[::4]):
        cases.append(
            Case(
                f"{case.name} (keep_datasets=False)",
                case.build,
                case.change,
                dict(case.loader),
                keep=False,
                per_loader=case.per_loader,
                family="keep_datasets=False",
            )
        )
    return cases
