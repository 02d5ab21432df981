"""A batch of a loader on a tether.Pool that goes on to another process, which checks it
after this process dropped it and received many batches more: ``reshared_batch.py queue``
sends it on a ``torch.multiprocessing`` queue, ``reshared_batch.py fork`` forks a child
while it holds the batch. Prints ``intact True`` when the other process saw the batch
whole."""

import os
import sys

import torch.multiprocessing as mp
from pool_datasets import Filled, holds
from torch.utils.data import DataLoader

import tether

BATCH = 16


def holder(batches: "mp.SimpleQueue", answers: "mp.SimpleQueue") -> None:
    first, batch = batches.get()
    answers.put("holding")
    assert batches.get() == "check"
    answers.put(holds(batch, first))


def through_a_queue(loader: DataLoader) -> bool:
    context = mp.get_context("fork")
    batches, answers = context.SimpleQueue(), context.SimpleQueue()
    child = context.Process(target=holder, args=(batches, answers))
    child.start()
    for i, batch in enumerate(loader):
        if i == 3:
            batches.put((i * BATCH, batch))
            assert answers.get() == "holding"
        del batch
    batches.put("check")
    intact = answers.get()
    child.join()
    return intact


def through_a_fork(loader: DataLoader) -> bool:
    go_r, go_w = os.pipe()
    pid = 0
    for i, batch in enumerate(loader):
        if i == 3:
            pid = os.fork()
            if pid == 0:
                os.close(go_w)
                os.read(go_r, 1)
                # numpy, not torch: no thread pool in a child forked from a threaded parent.
                array = batch.numpy().reshape(BATCH, -1)
                expected = list(range(i * BATCH, (i + 1) * BATCH))
                whole = array.min(1).tolist() == expected and array.max(1).tolist() == expected
                os._exit(0 if whole else 1)
            os.close(go_r)
        del batch
    os.write(go_w, b"x")
    os.close(go_w)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


if __name__ == "__main__":
    with tether.Pool(2) as pool:
        loader = DataLoader(
            Filled(BATCH * 40),
            batch_size=BATCH,
            num_workers=2,
            multiprocessing_context=pool.context(),
        )
        intact = through_a_queue(loader) if sys.argv[1] == "queue" else through_a_fork(loader)
    print("intact", intact, flush=True)
