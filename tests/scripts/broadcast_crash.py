"""A rank of a gloo broadcast loop in which one rank crashes: local rank 0 of the node with
two ranks dies of SIGSEGV after a few rounds; its node's other rank takes 5 s to exit (it
saves a checkpoint) whether it is stopped or its broadcast fails; every other rank fails at
once with gloo's own error.

    --crash-after S       when the crashing rank dies (1 s by default)
    --checkpoint S        how long the checkpoint takes (5 s by default)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--crash-after", type=float, default=1.0)
    parser.add_argument("--checkpoint", type=float, default=5.0)
    args = parser.parse_args()
    import torch
    import torch.distributed as dist

    two = os.environ["LOCAL_WORLD_SIZE"] == "2"
    crashes = two and os.environ["LOCAL_RANK"] == "0"
    saves = two and os.environ["LOCAL_RANK"] == "1"

    def save_then_exit(*_: Any) -> None:
        print(f"rank {os.environ['RANK']} saves a checkpoint", file=sys.stderr, flush=True)
        time.sleep(args.checkpoint)
        os._exit(1)

    if saves:
        signal.signal(signal.SIGTERM, save_then_exit)
    dist.init_process_group("gloo")
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} pid {os.getpid()}", flush=True)
    tensor = torch.zeros(1)
    started = time.monotonic()
    try:
        while True:
            dist.broadcast(tensor, src=0)
            if crashes and time.monotonic() - started > args.crash_after:
                os.kill(os.getpid(), signal.SIGSEGV)
            time.sleep(0.01)
    except RuntimeError:
        if saves:
            save_then_exit()
        raise


if __name__ == "__main__":
    main()
