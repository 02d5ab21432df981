"""Datasets for the DataLoader tests that need torch (a DataLoader worker imports torch
anyway, so these cost a worker nothing more)."""

from __future__ import annotations

import os
from typing import Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info


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
