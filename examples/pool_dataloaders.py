"""One tether.Pool serving a training loader, a validation loader (iterated together) and
some executor work, epoch after epoch, with the same worker processes throughout.

    python examples/pool_dataloaders.py
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

import tether


class Squares(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(i * i)])


def checksum(batch_sum: float) -> float:
    return batch_sum * 2


def main() -> None:
    with tether.Pool(4, preload=["torch"]) as pool:
        ctx = pool.context()
        started = pool.pids()
        print(f"pool workers: pids {started}")
        for epoch in range(3):
            train = DataLoader(
                Squares(256),
                batch_size=32,
                shuffle=True,
                num_workers=2,
                multiprocessing_context=ctx,
            )
            val = DataLoader(Squares(64), batch_size=8, num_workers=2, multiprocessing_context=ctx)
            total, batches = 0.0, 0
            for x, v in zip(train, val):  # four workers leased at once
                total += float(x.sum()) + float(v.sum())
                batches += 2
            # Between loaders the same workers run ordinary tasks too.
            doubled = pool.submit(checksum, total).result()
            print(
                f"epoch {epoch}: {batches} batches from 2 loaders (sum {total:,.0f}; "
                f"executor task agrees: {doubled == 2 * total}); "
                f"worker pids {pool.pids()}, the same as at the start: {pool.pids() == started}"
            )


if __name__ == "__main__":
    main()
