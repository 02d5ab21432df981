"""A small DDP training job on CPU (gloo), in the shape of torch's DDP tutorials: it reads
torchrun's environment, trains a toy model for a few steps, checks that every rank ends with
the same parameters, and prints one line per rank. It runs as a script or as a module.

    torchrun --standalone --nproc-per-node 2 ddp_train.py --epochs 3
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def train(epochs: int, fail_rank: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(ToyModel())
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(1000 + rank)
    for _ in range(epochs):
        optimizer.zero_grad()
        outputs = model(torch.randn(20, 10, generator=data))
        loss_fn(outputs, torch.randn(20, 5, generator=data)).backward()
        optimizer.step()
    if rank == fail_rank:
        print(f"rank {rank} is about to fail", flush=True)
        raise ValueError(f"rank {rank} diverged")
    checksum = torch.tensor([sum(float(p.detach().sum()) for p in model.parameters())])
    everyone = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(everyone, checksum)
    assert all(torch.allclose(c, checksum) for c in everyone), everyone
    print(
        f"rank={rank} local_rank={os.environ['LOCAL_RANK']} world={world}"
        f" epochs={epochs} params={float(checksum):.6f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--fail-rank", type=int, default=-1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        train(args.epochs, args.fail_rank)
    finally:
        if args.fail_rank < 0:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
