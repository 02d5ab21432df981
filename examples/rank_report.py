"""A rank script for `tether run`: every rank prints its place in the job; rank 2 fails
after a moment, and tether names it as the root cause and stops the others."""

import os
import sys
import time

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
print(
    f"rank {rank} of {world}, local rank {os.environ['LOCAL_RANK']}, "
    f"master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
    flush=True,
)
if rank == 2 and "--fail" in sys.argv:
    time.sleep(0.3)
    raise RuntimeError("rank 2 ran out of data")
time.sleep(0.5 if "--fail" not in sys.argv else 30)
