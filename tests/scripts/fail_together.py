"""A rank that prints its place, waits until a file exists, then fails with exit code 3 plus
its node rank (so that the exit code names the node whose rank a launcher reports)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main() -> None:
    trigger = Path(sys.argv[1])
    print(f"rank {os.environ['RANK']} pid {os.getpid()} waits", flush=True)
    while not trigger.exists():
        time.sleep(0.002)
    node = int(os.environ["GROUP_RANK"])
    print(f"rank {os.environ['RANK']} of node {node} fails on purpose", file=sys.stderr, flush=True)
    sys.exit(3 + node)


if __name__ == "__main__":
    main()
