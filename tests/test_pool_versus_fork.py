"""The differential harness: on ``pool.context()``, every batch of every epoch equals what
torch's fork workers give, whatever the parent changes between loaders (``pool_cases``:
rebinds at depths 1 to 7, a list or dict rebound at the old one's address, two rebinds,
lists, dicts, sets, tuples, ``__slots__``, properties, transforms in lists, tensors and
arrays, ``ConcatDataset``, ``Subset``, ``ChainDataset``, samplers), whatever a worker changes
in its copy (torch's ``IterableDataset`` sharding in ``worker_init_fn``, ``__getitem__`` and
``__iter__`` writing to the dataset), through ``refresh`` of wrapped objects, and with
``keep_datasets=False``. One pool serves every case; the datasets are a few items each."""

from __future__ import annotations

import collections
from typing import Any, Callable, Dict, List

import pool_cases
import pytest
import torch
from torch.utils.data import DataLoader

import tether

pytestmark = pytest.mark.timeout(300)

CASES = pool_cases.all_cases()
FAMILIES: Dict[str, List[pool_cases.Case]] = collections.defaultdict(list)
for _case in CASES:
    FAMILIES[_case.family].append(_case)


@pytest.fixture(scope="module")
def pool():
    with tether.Pool(2) as pool:
        yield pool


def _plain(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if isinstance(batch, (list, tuple)):
        return [_plain(b) for b in batch]
    return batch


def epochs(case: pool_cases.Case, context: Any, refresh: Callable[[Any], None]) -> List[Any]:
    """Every batch of every epoch of ``case`` on ``context`` (an error, by its type)."""
    dataset = case.build()
    out: List[Any] = []
    for epoch in range(case.epochs):
        try:
            if epoch:
                case.change(dataset, epoch, refresh)
            kwargs = dict(case.loader)
            if case.per_loader is not None:
                kwargs.update(case.per_loader(dataset, epoch))
            loader = DataLoader(
                dataset,
                multiprocessing_context=context,
                generator=torch.Generator().manual_seed(epoch),
                **kwargs,
            )
            out.append([_plain(batch) for batch in loader])
        except Exception as exc:  # noqa: BLE001 - the same error is the same outcome
            out.append(f"raised {type(exc).__name__}")
    return out


def test_the_harness_has_at_least_200_cases():
    assert len(CASES) >= 200
    assert len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_batch_of_every_epoch_equals_torch_fork(pool, family):
    wrong = []
    for case in FAMILIES[family]:
        expected = epochs(case, "fork", lambda obj: None)
        got = epochs(case, pool.context(keep_datasets=case.keep), pool.refresh)
        if got != expected:
            wrong.append(f"{case.name} ({case.loader}):\n  fork: {expected}\n  pool: {got}")
    assert not wrong, f"{len(wrong)} of {len(FAMILIES[family])} cases differ:\n" + "\n".join(wrong)
