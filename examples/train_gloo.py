"""A tiny CPU training job over 2 ranks with torch.distributed (gloo) and
DistributedDataParallel, started with tether.spawn."""

import socket

import tether


def train(rank: int, world_size: int, port: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    true_w = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    for step in range(30):
        x = torch.randn(32, 4, generator=generator)
        y = x @ true_w.T
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 10 == 9:
            print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)
    weights = model.module.weight.detach()
    gathered = [torch.zeros_like(weights) for _ in range(world_size)]
    dist.all_gather(gathered, weights)
    if rank == 0:
        same = all(torch.equal(gathered[0], w) for w in gathered)
        print(f"ranks hold identical weights: {same}; learned {weights.flatten().tolist()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tether.spawn(train, args=(2, port), nprocs=2)
    print("training finished on 2 ranks")
