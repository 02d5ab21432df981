"""Datasets for the DataLoader tests that need torch (a DataLoader worker imports torch
anyway, so these cost a worker nothing more)."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from typing import Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info


class Empties(torch.utils.data.Dataset):
    """Item i: an empty float tensor (a batch of them holds no byte)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.empty(0)


class Tensors(torch.utils.data.Dataset):
    """Item i: a (3,) float tensor full of i."""

    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3,), float(i))


class Stream(IterableDataset):
    """0..n-1, split between the workers by worker id."""

    def __init__(self, n: int = 50) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, self.n, step))


class RandomDraws(torch.utils.data.Dataset):
    """Item i: (python random, torch random) drawn in the worker."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        import random

        return torch.tensor([random.random(), torch.rand(1).item(), float(os.getpid() > 0)])


class ManyTensors(torch.utils.data.Dataset):
    """Each item is a list of 300 small tensors (more fds than one message carries)."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> list:
        return [torch.full((2,), float(i * 1000 + k)) for k in range(300)]


class HoldsTensor(torch.utils.data.Dataset):
    """Item i: the sum of the tensor it holds, and how many times it was unpickled here."""

    unpickled = 0

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values

    def __setstate__(self, state: dict) -> None:
        type(self).unpickled += 1
        self.__dict__.update(state)

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(self.values.sum()), float(type(self).unpickled)])


class HoldsArray(torch.utils.data.Dataset):
    """Item i: facts about the numpy array it holds, as a worker sees it: its first value,
    whether it is writable, and whether its memory is a mapped memfd."""

    def __init__(self, array: object) -> None:
        self.array = array

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> torch.Tensor:
        address = self.array.__array_interface__["data"][0]
        in_memfd = False
        with open("/proc/self/maps") as maps:
            for line in maps:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                if start <= address < end:
                    in_memfd = "/memfd:" in line
        return torch.tensor(
            [float(self.array[0]), float(self.array.flags.writeable), float(in_memfd)]
        )


class Images(torch.utils.data.Dataset):
    """``n`` images of 3x224x224 float32, item i full of i."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3, 224, 224), float(i))


def refuse_shared_memory(worker_id: int) -> None:
    """A ``worker_init_fn`` after which this worker's process cannot allocate shared memory
    (as when the machine's memory runs out)."""
    import errno

    def refuse(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    os.posix_fallocate = refuse


class Filled(torch.utils.data.Dataset):
    """``n`` items of ``shape`` float32, item i full of i (a batch of 16 of the default
    shape is 192 KiB: big enough for its storage to go back to its worker)."""

    def __init__(self, n: int, shape: tuple = (3, 32, 32)) -> None:
        self.n = n
        self.shape = shape

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full(self.shape, float(i))


def holds(batch: torch.Tensor, first: int) -> bool:
    """Whether ``batch`` is still the batch of the items ``first``, ``first + 1``... of a
    ``Filled`` dataset, in every byte."""
    expected = torch.arange(first, first + len(batch), dtype=batch.dtype)
    flat = batch.reshape(len(batch), -1)
    return bool(torch.equal(flat.amin(1), expected) and torch.equal(flat.amax(1), expected))


class CollateKeepingLast:
    """torch's ``default_collate``, which keeps its last 6 batches in the worker: each batch
    comes with whether those were all still intact when it was made."""

    def __init__(self) -> None:
        self.kept: list = []

    def __call__(self, items: list) -> tuple:
        from torch.utils.data import default_collate

        batch = default_collate(items)
        intact = all(holds(*kept) for kept in self.kept)
        self.kept = [*self.kept[-5:], (batch, int(batch[0, 0, 0, 0]))]
        return batch, intact


class Marked(torch.utils.data.Dataset):
    """Item i: ``(i, mark)``; the parent's mark stays 0. What runs in a worker between two
    loaders sets its copy's mark to ``MARK`` (see the ``mark_*`` helpers)."""

    def __init__(self, n: int = 6, go: str = "") -> None:
        self.n = n
        self.mark = 0
        #: A file whose existence lets ``mark_from_a_thread``'s thread write.
        self.go = go

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple:
        return (i, self.mark)


MARK = 999


def mark_from_a_thread(worker_id: int) -> None:
    """``worker_init_fn``: a thread that outlives the loader marks the copy once told to
    (the go file exists), then writes ``<go>.<pid>``."""
    dataset = get_worker_info().dataset

    def mark() -> None:
        while not os.path.exists(dataset.go):
            time.sleep(0.005)
        dataset.mark = MARK
        with open(f"{dataset.go}.{os.getpid()}", "w"):
            pass

    threading.Thread(target=mark, daemon=True).start()


def mark_on_sigusr1(worker_id: int) -> None:
    """``worker_init_fn``: SIGUSR1 marks the copy."""
    dataset = get_worker_info().dataset
    signal.signal(signal.SIGUSR1, lambda *_: setattr(dataset, "mark", MARK))


class MarkedByAFinalizer(Marked):
    """A ``Marked`` whose last item leaves a reference cycle behind, whose finalizer marks
    the copy when the garbage collector frees it."""

    def __getitem__(self, i: int) -> tuple:
        item = (i, self.mark)
        if i == self.n - 1:
            _Marker(self)
        return item


class MarkedByAFinalizerCollectedLater(MarkedByAFinalizer):
    """A ``MarkedByAFinalizer`` whose items each begin with a collection of the youngest
    generation (as any item that allocates enough does): in a worker that still holds the
    last loader's garbage, the first item runs its finalizer."""

    def __getitem__(self, i: int) -> tuple:
        gc.collect(0)
        return super().__getitem__(i)


class _Marker:
    def __init__(self, dataset: Marked) -> None:
        self.dataset = dataset
        self.cycle = self

    def __del__(self) -> None:
        self.dataset.mark = MARK


class MarkedByAResurrectingFinalizer(Marked):
    """As ``MarkedByAFinalizer``, but the finalizer keeps its object alive: the collection
    that runs it frees nothing."""

    def __getitem__(self, i: int) -> tuple:
        item = (i, self.mark)
        if i == self.n - 1:
            _Resurrecting(self)
        return item


#: What ``_Resurrecting`` finalizers keep alive.
RESURRECTED: list = []


class _Resurrecting(_Marker):
    def __del__(self) -> None:
        super().__del__()
        RESURRECTED.append(self)


#: The ``Registered`` copies this process unpickled.
REGISTERED: list = []


class Registered(Marked):
    """A ``Marked`` that each copy registers in a module global as it is unpickled, where
    an executor task can reach it (``mark_registered``)."""

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        REGISTERED.append(self)


def mark_registered(_: int = 0) -> int:
    """An executor task: marks every ``Registered`` copy of this worker; its pid."""
    for dataset in REGISTERED:
        dataset.mark = MARK
    time.sleep(0.02)  # the other worker takes the next task
    return os.getpid()


class RegisteredCollecting(Registered):
    """A ``Registered`` whose items each begin with a collection of the youngest generation
    (see ``MarkedByAFinalizerCollectedLater``)."""

    def __getitem__(self, i: int) -> tuple:
        gc.collect(0)
        return super().__getitem__(i)


def leave_a_marker(_: int = 0) -> int:
    """An executor task: leaves garbage whose finalizer marks every ``Registered`` copy of
    this worker; its pid."""
    for dataset in REGISTERED:
        _Marker(dataset)
    time.sleep(0.02)  # the other worker takes the next task
    return os.getpid()
