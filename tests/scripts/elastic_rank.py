"""A rank of a multi-node test job: it prints its place in the job, then either waits to be
stopped, fails, or joins its peers in one all-reduce and ends.

    --finish-at N         all-reduce and end in a world of N ranks (else wait to be stopped)
    --after DIR:N         ... but only once a world of N ranks has been seen (DIR holds marks)
    --fail-node G         local rank 0 of node rank G fails with exit code 3
    --fail-here           local rank 0 of this node fails with exit code 3
    --fail-after S        ... after S seconds (0.5 by default)
    --fail-when FILE      ... once FILE exists
    --sleep S             the longest wait, in seconds
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def place() -> str:
    keys = ["RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_RANK"]
    keys += ["TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE", "MASTER_PORT"]
    return " ".join(f"{k}={os.environ[k]}" for k in keys)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--finish-at", type=int, default=0)
    parser.add_argument("--after", default="")
    parser.add_argument("--fail-node", type=int, default=-1)
    parser.add_argument("--fail-here", action="store_true")
    parser.add_argument("--fail-after", type=float, default=0.5)
    parser.add_argument("--fail-when", default="")
    parser.add_argument("--sleep", type=float, default=120)
    args = parser.parse_args()
    print(f"place {place()}", flush=True)
    world = int(os.environ["WORLD_SIZE"])
    if args.after:
        marks, seen = args.after.rsplit(":", 1)
        Path(marks, f"world{world}").touch()
        if not Path(marks, f"world{seen}").exists():
            world = -1
    failing = args.fail_here or int(os.environ["GROUP_RANK"]) == args.fail_node
    if failing and os.environ["LOCAL_RANK"] == "0":
        time.sleep(args.fail_after)
        while args.fail_when and not Path(args.fail_when).exists():
            time.sleep(0.05)
        print(f"rank {os.environ['RANK']} fails on purpose", file=sys.stderr, flush=True)
        sys.exit(3)
    if world != args.finish_at:
        time.sleep(args.sleep)
        sys.exit(0)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    print(f"sum {int(total.item())} rank {dist.get_rank()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
