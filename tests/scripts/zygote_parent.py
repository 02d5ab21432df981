"""A parent that will be killed with SIGKILL while the zygote, its ready children and
forkserver ranks run: prints every pid as one JSON line, then waits. Nothing here writes on
the terminal; whatever appears there came from the processes tether started."""

import json
import time

import tether
from tether.zygote import client


def sleeper(i):
    time.sleep(60)


if __name__ == "__main__":
    tether.warm_up(processes=2)
    ctx = tether.start_processes(sleeper, nprocs=3, join=False)
    time.sleep(0.5)  # the zygote forks its ready children again
    print(json.dumps(ctx.pids() + client.pids()), flush=True)
    time.sleep(60)
