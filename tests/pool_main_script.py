"""The script of ``test_pool_main_globals.py``, run as ``__main__`` (its datasets, helpers and
transforms are ``__main__``'s, as in a user's training script): each case iterates three
loaders over a dataset, changing what the main block set between them, on torch's fork
workers and on a ``tether.Pool``; it prints, per case, every batch of every loader and what
the parent's objects hold afterwards, as one JSON object."""

import functools
import json
import sys
import threading
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import tether

SCALE = 1
OFFSETS = [0]
TABLE = {"k": 0}
WIDTH = 4


def helper(x):
    return x * SCALE + OFFSETS[0]


def deep_helper(x):
    return helper(x) + TABLE["k"]


class ReadsGlobal(Dataset):
    def __len__(self):
        return WIDTH

    def __getitem__(self, i):
        return i * SCALE


class ReadsHelper(Dataset):
    def __len__(self):
        return WIDTH

    def __getitem__(self, i):
        return deep_helper(i)


class WithTransform(Dataset):
    def __init__(self, transform):
        self.transform = transform

    def __len__(self):
        return WIDTH

    def __getitem__(self, i):
        return self.transform(i)


class Cache(Dataset):
    """A cache that ``__getitem__`` writes: in place, through a view, through ``.numpy()``."""

    def __init__(self, kind, size):
        self.kind = kind
        base = torch.zeros(size, dtype=torch.float64)
        self.cache = base.numpy().copy() if kind == "array" else base

    def __len__(self):
        return WIDTH

    def __getitem__(self, i):
        if self.kind == "view":
            view = self.cache[1:]
            view[i - 1] += 1
            return float(self.cache[i])
        if self.kind == "numpy":
            self.cache.numpy()[i] += 1
        else:
            self.cache[i] += 1
        return float(self.cache[i])

    def state(self):
        return float(self.cache.sum())


class ClassCache(Dataset):
    seen = {}

    def __len__(self):
        return WIDTH

    def __getitem__(self, i):
        ClassCache.seen[i] = ClassCache.seen.get(i, 0) + 1
        return ClassCache.seen[i]

    def state(self):
        return len(ClassCache.seen)


def plain(batch):
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if isinstance(batch, (list, tuple)):
        return [plain(b) for b in batch]
    return batch


def make_local(step):
    def local(x):
        return x + step * SCALE

    return local


def loaders(case, context):
    """Every batch of three loaders of ``case`` on ``context``, and the parent's state."""
    global SCALE
    name, batch_size, workers = case
    SCALE, OFFSETS[0], TABLE["k"] = 10, 0, 0  # what the main block set
    state = None
    out = []
    for epoch in range(3):
        kwargs = {}
        if name == "global":
            dataset = ReadsGlobal()
        elif name == "global_rebound":
            SCALE = 10 * (epoch + 1)
            dataset = ReadsGlobal()
        elif name == "helpers":
            OFFSETS[0], TABLE["k"] = epoch, 100 * epoch
            dataset = ReadsHelper()
        elif name == "lambda":
            dataset = WithTransform(lambda x, e=epoch: x * SCALE + e)  # noqa: B023 (read late)
        elif name == "closure":
            shift = 7 * epoch
            dataset = WithTransform(lambda x: x + shift)  # noqa: B023 (a closure, on purpose)
        elif name == "local":
            dataset = WithTransform(make_local(epoch))
        elif name == "partial":
            dataset = WithTransform(functools.partial(lambda x, k: x * k, k=epoch + SCALE))
        elif name == "collate":
            dataset = ReadsGlobal()
            kwargs["collate_fn"] = lambda items, e=epoch: [x + e * SCALE for x in items]  # noqa: B023
        elif name == "init_fn":
            dataset = WithTransform(helper)
            kwargs["worker_init_fn"] = lambda worker: OFFSETS.__setitem__(0, 1000)
        elif name.startswith("cache_"):
            kind, size = name[len("cache_") :].split("_")
            if state is None:
                state = Cache(kind, int(size))
            dataset = state
        elif name == "class_cache":
            state = state or ClassCache()
            dataset = state
        else:
            raise ValueError(name)
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=workers,
            multiprocessing_context=context,
            **kwargs,
        )
        out.append([plain(batch) for batch in loader])
    return {"batches": out, "parent": None if state is None else state.state()}


NAMES = [
    "global",
    "global_rebound",
    "helpers",
    "lambda",
    "closure",
    "local",
    "partial",
    "collate",
    "init_fn",
    "cache_tensor_16",
    "cache_tensor_65536",
    "cache_view_16",
    "cache_view_65536",
    "cache_numpy_16",
    "cache_numpy_65536",
    "cache_array_16",
    "cache_array_262144",
    "class_cache",
]
CASES = [(name, b, w) for name in NAMES for b, w in ((1, 1), (2, 2))]

LOCK = threading.Lock()


class ReadsLock(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        with LOCK:
            return i


def unpicklable(pool):
    """What a loader whose dataset reads an unpicklable global raises on the pool."""
    try:
        list(DataLoader(ReadsLock(), num_workers=1, multiprocessing_context=pool.context()))
    except Exception as exc:  # noqa: BLE001 - the error is what is compared
        return f"{type(exc).__name__}: {exc}"
    return "no error"


class Raises(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        raise ValueError(f"item {i} is broken")


def raised(context):
    """The lines of a worker's traceback that name this script (file, line, function) and
    the line that raised: what a user reads to find the fault."""
    try:
        list(DataLoader(Raises(), num_workers=1, multiprocessing_context=context))
    except ValueError as exc:
        lines = str(exc).splitlines()
        return [
            line.strip()
            for at, line in enumerate(lines)
            if Path(__file__).name in line or (at and Path(__file__).name in lines[at - 1])
        ]
    return ["no error"]


if __name__ == "__main__":
    results = {}
    with tether.Pool(2) as pool:
        for case in CASES:
            results["/".join(map(str, case))] = {
                "fork": loaders(case, "fork"),
                "pool": loaders(case, pool.context()),
            }
        results["unpicklable"] = unpicklable(pool)
        results["raises"] = {"fork": raised("fork"), "pool": raised(pool.context())}
    json.dump(results, sys.stdout)
