"""A SharedList through a multiprocessing queue (``ForkingPickler`` with no process start
at hand: the fd goes through multiprocessing's resource sharer) to a spawn child, which
reports what it maps. Prints ``same pages`` when the child maps this process's copy."""

import multiprocessing
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import share_helpers as helpers

import tether


def receive(inbox, outbox):
    outbox.put(helpers.length_and_mapped(inbox.get()))


if __name__ == "__main__":
    if sys.argv[1:] == ["torch"]:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
    else:
        ctx = multiprocessing.get_context("spawn")
    shared = tether.share(helpers.samples(1000))
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=receive, args=(inbox, outbox))
    child.start()
    inbox.put(shared)
    length, inodes = outbox.get(timeout=60)
    child.join(timeout=60)
    print("same pages" if length == 1000 and inodes == helpers.mapped() else (length, inodes))
