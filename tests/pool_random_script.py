"""The script of ``test_pool_random_versus_fork.py``, run as ``__main__``: random sequences
of changes between loaders, the same on two equal datasets, one iterated by torch's fork
workers and one by a ``tether.Pool``. The parent rebinds and writes in place what the
dataset's code reads (``__main__``'s globals, a list, a dict, a small and a big numpy
array, a tensor, through ``.numpy()``, a lambda as transform, the list's length) or
collects its garbage; the workers write their copies (caches filled by ``__getitem__``)
and, as the case says, leave behind a thread, garbage whose finalizer writes the copy, a
rebound global, or writes to the copy's list, dict, tensor, arrays and transform.

``python pool_random_script.py SEED LOADERS`` prints one JSON object: how many loaders ran
and, for each difference from fork (batches, or what the parent's objects hold after the
loader), what it was."""

import gc
import glob
import json
import os
import random
import sys
import tempfile
import threading
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

import tether

SCALE = 1
OFFSET = np.zeros(3)
#: Items of the dataset's arrays, tensors and caches (its list may grow past it).
ROWS = 24


def helper(x):
    return x * SCALE


class Marker:
    """Garbage (a reference cycle) whose finalizer writes the dataset's copy."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.cycle = self

    def __del__(self):
        self.dataset.arr[:, 0] += 500


def mischief(dataset, i):
    """What a worker does beyond its items, as ``dataset.mischief`` says (at item 1, or for
    garbage, at the last item; fork's workers lose all of it when they exit)."""
    global SCALE
    kind = dataset.mischief
    if not kind or get_worker_info() is None:
        return
    if kind == 2:
        gc.collect(0)  # as an item that allocates enough: the last loader's garbage goes
        if i == len(dataset) - 1:
            Marker(dataset)
    if i != 1:
        return
    if kind == 1:

        def later():
            # Once the loader is over (the parent says so: ``release``), never during one.
            deadline = time.monotonic() + 20
            while not os.path.exists(dataset.go) and time.monotonic() < deadline:
                time.sleep(0.002)
            dataset.items[0] += 1000
            open(f"{dataset.go}.{os.getpid()}", "w").close()

        threading.Thread(target=later, daemon=True).start()
    elif kind == 3:
        SCALE = 999
    elif kind == 4:
        OFFSET[0] += 77
    elif kind == 5:
        dataset.items[2] = -5
    elif kind == 6:
        dataset.nested["k"].append(42)
    elif kind == 7:
        dataset.transform = lambda v: -v
    elif kind == 8:
        dataset.t.add_(1)
    elif kind == 9:
        dataset.big[:10] += 3


class Data(Dataset):
    def __init__(self):
        self.items = list(range(ROWS))
        self.arr = np.arange(ROWS * 3, dtype=np.float64).reshape(ROWS, 3)
        self.big = np.zeros((300_000, 1), dtype=np.float32)  # proven by its pages
        self.t = torch.arange(ROWS, dtype=torch.float32)
        self.cache = torch.zeros(ROWS)
        self.npcache = np.zeros(ROWS)
        self.memo = {}
        self.transform = lambda v: v + 0
        self.nested = {"k": [1, 2, (3, 4)]}
        self.mischief = 0
        #: The file whose existence lets the threads of ``mischief`` write (see ``release``).
        self.go = ""

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        j = i % ROWS
        mischief(self, i)
        self.cache[j] += 1
        self.npcache[j] += 1
        self.memo[i] = self.memo.get(i, 0) + 1
        self.t[j : j + 1].numpy()[0] += 0  # a write through a numpy view
        value = helper(self.items[i]) + float(self.arr[j].sum()) + float(OFFSET.sum())
        value += float(self.big[i, 0]) + float(self.t[j])
        value += self.nested["k"][0] + len(self.nested["k"])
        return torch.tensor(
            [self.transform(value), self.cache[j], self.npcache[j], self.memo[i], self.arr[j, 0]]
        )


def change(rng, datasets):
    """One random change, made the same way to each of ``datasets``; its number."""
    global SCALE, OFFSET
    kind, i, v = rng.randrange(20), rng.randrange(ROWS), rng.randrange(100)
    kind = min(kind, 13)  # 7 changes in 20 set the workers' mischief
    mischief = rng.randrange(10)
    if kind == 0:
        SCALE = v
    elif kind == 1:
        OFFSET = np.full(3, float(v))
    elif kind == 2:
        OFFSET[i % 3] = v
    elif kind == 12:
        gc.collect()
    for data in datasets:
        if kind == 3:
            data.items[i] = v
        elif kind == 4:
            data.arr[i, 1] += v
        elif kind == 5:
            data.big[i * 1000 if v % 2 else i, 0] = v
        elif kind == 6:
            data.t[i] = v
        elif kind == 7:
            data.transform = (lambda w: lambda x: x * w)(v)
        elif kind == 8:
            data.nested["k"].append(v)
        elif kind == 9:
            data.items.append(v)
        elif kind == 10:
            data.t.numpy()[i] = v
        elif kind == 11:
            data.nested["k"][0] = v
        elif kind == 13:
            data.mischief = mischief
    return kind


def batches(dataset, context, workers):
    loader = DataLoader(dataset, batch_size=4, num_workers=workers, multiprocessing_context=context)
    return torch.cat(list(loader)).tolist()


def release(go):
    """Lets the thread the pool loader just left (``mischief`` 1) write its worker's copy,
    waits until it did, and closes the gate again."""
    open(go, "w").close()
    deadline = time.monotonic() + 20
    while not glob.glob(f"{go}.*") and time.monotonic() < deadline:
        time.sleep(0.002)
    for path in [go, *glob.glob(f"{go}.*")]:
        os.unlink(path)


def parent(data):
    """What the parent's objects hold."""
    return [
        data.items, data.arr.tolist(), data.t.tolist(), data.cache.tolist(),
        data.npcache.tolist(), sorted(data.memo.items()), float(data.big.sum()),
    ]  # fmt: skip


def main():
    seed, loaders = int(sys.argv[1]), int(sys.argv[2])
    rng = random.Random(seed)
    on_fork, on_pool = Data(), Data()
    differences = []
    with tempfile.TemporaryDirectory() as gates, tether.Pool(2) as pool:
        on_fork.go = on_pool.go = os.path.join(gates, "go")
        for loader in range(loaders):
            changes = [change(rng, [on_fork, on_pool]) for _ in range(rng.randrange(3))]
            workers = rng.choice([1, 2])
            fork = batches(on_fork, "fork", workers)
            # Twice: the second right after the first, while its workers are not idle.
            for again in range(2):
                ours = batches(on_pool, pool.context(), workers)
                if on_pool.mischief == 1:
                    release(on_pool.go)
                where = (
                    f"seed {seed}, loader {loader}{' again' if again else ''}, changes "
                    f"{changes}, mischief {on_pool.mischief}"
                )
                if fork != ours:
                    rows = [r for r, (a, b) in enumerate(zip(fork, ours)) if a != b]
                    first = rows[0] if rows else 0
                    differences.append(
                        f"{where}: fork {fork[first]}, pool {ours[first]} (rows {rows})"
                    )
            if parent(on_fork) != parent(on_pool):
                differences.append(f"{where}: the parent's objects differ")
    print(json.dumps({"loaders": loaders, "differences": differences}))


if __name__ == "__main__":
    main()
