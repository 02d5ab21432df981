"""tether.spawn with torch: shared-memory tensors as arguments, a DataLoader with workers
inside a child, and torch.distributed over gloo."""

from __future__ import annotations

import socket

import pytest

torch = pytest.importorskip("torch", reason="torch is a test dependency: `make test` installs it")

import tether  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def add_rank(i, tensor, out_queue):
    tensor[i] += i + 1
    out_queue.put((i, tensor.is_shared()))


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_shared_tensors_as_arguments(method):
    import multiprocessing

    tensor = torch.zeros(2).share_memory_()
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    tether.start_processes(add_rank, args=(tensor, queue), nprocs=2, start_method=method)
    assert tensor.tolist() == [1.0, 2.0]
    assert sorted(queue.get() for _ in range(2)) == [(0, True), (1, True)]


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([i * i])


def load_in_child(i, out_queue):
    loader = torch.utils.data.DataLoader(Squares(), batch_size=4, num_workers=2)
    out_queue.put([batch.flatten().tolist() for batch in loader])


def test_dataloader_with_workers_inside_a_child():
    import multiprocessing

    queue = multiprocessing.get_context("spawn").SimpleQueue()
    tether.spawn(load_in_child, args=(queue,), nprocs=1)
    assert queue.get() == [[0, 1, 4, 9], [16, 25, 36, 49]]


def all_reduce(rank, world, port, out_queue):
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    out_queue.put(value.item())
    dist.destroy_process_group()


def test_gloo_all_reduce_over_two_ranks():
    import multiprocessing

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    tether.spawn(all_reduce, args=(2, port, queue), nprocs=2)
    assert [queue.get(), queue.get()] == [3.0, 3.0]
