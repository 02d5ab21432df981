"""A pool never serves a stale dataset: what the parent changes between loaders reaches the
workers wherever it is and however large the dataset, what a worker changes in its copy
does not outlive its loader, and ``pool.refresh`` reaches through the datasets that wrap
another. Each test compares with torch's fork workers on the same program."""

from __future__ import annotations

from typing import Any, Callable, List

import pool_cases as cases
import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, Subset

import tether

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pool():
    with tether.Pool(2) as pool:
        yield pool


def values(dataset: Any, context: Any, **kwargs: Any) -> List[Any]:
    """Every item of one loader (2 workers unless said otherwise, no batching)."""
    kwargs.setdefault("num_workers", 2)
    loader = DataLoader(dataset, batch_size=None, multiprocessing_context=context, **kwargs)
    return [x.tolist() if isinstance(x, torch.Tensor) else x for x in loader]


def test_an_iterable_dataset_sharded_in_worker_init_fn_yields_forks_samples_epoch_after_epoch(
    pool,
):
    # torch's documented example: worker_init_fn narrows the worker's copy to its shard.
    def epochs(context: Any) -> List[List[Any]]:
        dataset = cases.Range(3, 20)  # 17 samples
        return [
            sorted(v for v, *_ in values(dataset, context, worker_init_fn=cases.shard))
            for _ in range(3)
        ]

    expected = epochs("fork")
    assert [len(e) for e in expected] == [17, 17, 17]
    assert epochs(pool.context()) == expected


def test_a_list_rebound_where_the_old_list_was_is_seen_by_the_next_loader(pool):
    def epochs(context: Any) -> Any:
        dataset = cases.Items([0, 1, 2, 3])
        seen, addresses = [values(dataset, context)], [id(dataset.items)]
        dataset.items = None  # the old list is freed: the new one may take its address
        dataset.items = [10, 11, 12, 13]
        addresses.append(id(dataset.items))
        seen.append(values(dataset, context))
        dataset.items = [1000, 1100]  # two rebinds: the second takes the first's address
        dataset.items = [1000, 1200]
        addresses.append(id(dataset.items))
        seen.append(values(dataset, context))
        return seen, addresses

    expected, _ = epochs("fork")
    got, addresses = epochs(pool.context())
    assert expected == [[0, 1, 2, 3], [10, 11, 12, 13], [1000, 1200]]
    assert got == expected
    # CPython did give a new list the address of the one the workers had been sent.
    assert addresses[1] == addresses[0] or addresses[2] == addresses[1]


def _wide() -> Any:
    dataset = cases.Graph(None)
    for i in range(100):
        setattr(dataset, f"field{i}", i)
    dataset.epoch = 0
    return dataset


def _many_objects(side: int = 30) -> Any:
    """A dataset whose ``epoch`` comes first, before ``side`` objects of ``side`` objects."""
    dataset = cases.Graph.__new__(cases.Graph)
    dataset.epoch = 0
    rows = {
        f"row{i}": cases.Bag(**{f"col{j}": cases.Node(j) for j in range(side)}) for i in range(side)
    }
    dataset.__init__(cases.Bag(**rows))
    return dataset


def _set_epoch(dataset: Any) -> None:
    dataset.epoch = 3


def _concat_member(dataset: Any) -> None:
    dataset.datasets[1].root.value = 3


def _slots_transform(dataset: Any) -> None:
    dataset.transform.transforms[0].factor = 3


def _five_deep(dataset: Any) -> None:
    cases.link(dataset.root, 5).value = 3


@pytest.mark.parametrize(
    "build, change",
    [
        (_wide, _set_epoch),
        (_many_objects, _set_epoch),
        (lambda: _many_objects(150), _set_epoch),
        (
            lambda: ConcatDataset([cases.Graph(cases.Node(1)), cases.Graph(cases.Node(2))]),
            _concat_member,
        ),
        (
            lambda: cases.Graph(None, transform=cases.Compose([cases.SlotScale(2)])),
            _slots_transform,
        ),
        (lambda: cases.Graph(cases.chain(5, 1)), _five_deep),
    ],
    ids=[
        "an attribute of a dataset of 100 attributes",
        "an attribute of a dataset holding 900 objects",
        "an attribute of a dataset holding 22,500 objects, more than the pool compares",
        "an attribute of a ConcatDataset member",
        "an attribute of a __slots__ transform",
        "an attribute 5 levels deep",
    ],
)
def test_a_change_past_any_budget_or_depth_is_seen_by_the_next_loader(
    pool, build: Callable[[], Any], change: Callable[[Any], None]
):
    def epochs(context: Any) -> List[Any]:
        dataset = build()
        first = values(dataset, context)
        change(dataset)
        return [first, values(dataset, context)]

    expected = epochs("fork")
    assert expected[0] != expected[1]
    assert epochs(pool.context()) == expected


@pytest.mark.parametrize(
    "wrap",
    [lambda ds: Subset(ds, [0, 1]), lambda ds: ConcatDataset([ds])],
    ids=["Subset", "ConcatDataset"],
)
def test_refresh_of_a_dataset_refreshes_the_loader_that_wraps_it(pool, tmp_path, wrap):
    path = tmp_path / "labels.txt"
    path.write_text("first")
    dataset = cases.Reread(str(path))  # reads its file when made or unpickled
    wrapped = wrap(dataset)
    assert values(wrapped, pool.context()) == ["first", "first"]
    path.write_text("second")
    pool.refresh(dataset)  # the workers unpickle it again: it reads the file again
    assert values(wrapped, pool.context()) == ["second", "second"]
