"""A DataLoader of 64 x 3x224x224 float32 batches (37 MiB each, two in flight per worker;
a pool worker reuses the storages of those dropped), on torch's fork workers or on a
tether.Pool: ``big_batches.py fork|pool``. Prints ``batches N`` when every batch arrived
whole."""

import sys

import torch
from pool_datasets import Images
from torch.utils.data import DataLoader

import tether

if __name__ == "__main__":
    pool = tether.Pool(2) if sys.argv[1] == "pool" else None
    context = "fork" if pool is None else pool.context()
    count = 0
    for i, batch in enumerate(
        DataLoader(Images(64 * 12), batch_size=64, num_workers=2, multiprocessing_context=context)
    ):
        assert batch.shape == (64, 3, 224, 224)
        assert torch.equal(
            batch[:, 0, 0, 0], torch.arange(64 * i, 64 * (i + 1), dtype=torch.float32)
        )
        count += 1
    print("batches", count, flush=True)
    if pool is not None:
        pool.shutdown()
