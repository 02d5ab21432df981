"""mnist_hogwild's pattern, written for ``import torch.multiprocessing as mp`` and run with
``import tether as mp``: the start method set once, a model in shared memory, one
``mp.Process`` per rank training it in place, then join. Prints one JSON line."""

import json
import os
import sys

import torch
from torch import nn

import tether as mp


def train(rank, model, steps, results):
    torch.manual_seed(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        x = torch.randn(32, 4)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        loss.backward()
        optimizer.step()
    results.put((rank, os.getpid(), model.weight.is_shared()))


def loss_of(model):
    torch.manual_seed(1000)
    x = torch.randn(256, 4)
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).item()


if __name__ == "__main__":
    mp.set_start_method(sys.argv[1], force=True)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    model.share_memory()
    before = loss_of(model)
    results = mp.Queue()
    processes = []
    for rank in range(2):
        p = mp.Process(target=train, args=(rank, model, 40, results))
        p.start()
        processes.append(p)
    reports = sorted(results.get(timeout=120) for _ in processes)
    for p in processes:
        p.join()
    print(
        json.dumps(
            {
                "start_method": mp.get_start_method(),
                "exitcodes": [p.exitcode for p in processes],
                "reports": reports,
                "parent": os.getpid(),
                "loss_before": before,
                "loss_after": loss_of(model),
            }
        )
    )
