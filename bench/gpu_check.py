"""What only a machine with a GPU can check, prepared to run wherever one is available:

1. ``tether run``'s warm ranks (forks of the node's zygote, which never touches a GPU) each
   initialize CUDA on their own device and run an NCCL all-reduce;
2. a parent that has initialized CUDA starts ``tether.spawn`` children from the zygote, and
   each uses CUDA (a plain fork of such a parent could not);
3. a ``tether.Pool`` loader with ``pin_memory=True`` gives pinned batches.

Without a GPU (no ``/dev/nvidia*`` device, or torch sees none), it says so and exits 0.
Otherwise it prints one line per check and exits 1 when one failed.

    python bench/gpu_check.py [--ranks 2]
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Callable, List, Tuple

#: A rank of check 1: CUDA is not initialized when its script starts (the zygote left it
#: alone), then it initializes it and all-reduces its rank over NCCL.
NCCL_RANK = """
import os, sys
import torch
import torch.distributed as dist
fresh = not torch.cuda.is_initialized()
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl")
value = torch.full((1,), float(dist.get_rank() + 1), device="cuda")
dist.all_reduce(value)
world = dist.get_world_size()
expected = world * (world + 1) / 2
print(f"rank {dist.get_rank()} fresh={fresh} sum={value.item()} expected={expected}")
dist.destroy_process_group()
sys.exit(0 if fresh and value.item() == expected else 1)
"""


def gpus() -> int:
    """How many GPUs torch sees (0 without a device node: torch is not even imported)."""
    if not glob.glob("/dev/nvidia[0-9]*"):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def warm_ranks_use_nccl(ranks: int) -> str:
    tether = str(Path(sys.executable).with_name("tether"))
    with tempfile.TemporaryDirectory(prefix="tether-gpu-") as tmp:
        script = Path(tmp, "rank.py")
        script.write_text(NCCL_RANK)
        argv = [tether, "run", "--standalone", "--nproc-per-node", str(ranks), str(script)]
        env = dict(os.environ, TETHER_LOG="info")
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    forks = proc.stderr.count("(a fork") + proc.stderr.count("(a blank")
    if "warm ranks are off" in proc.stderr or forks < ranks:
        raise AssertionError(f"the ranks were not warm:\n{proc.stderr}")
    return f"{ranks} warm ranks all-reduced over NCCL: " + " | ".join(proc.stdout.splitlines())


def uses_cuda(rank: int, devices: int) -> None:
    import torch

    device = torch.device("cuda", rank % devices)
    value = torch.ones(4, device=device) * (rank + 1)
    assert value.sum().item() == 4 * (rank + 1)


def cuda_parent_spawns_from_the_zygote(ranks: int) -> str:
    import torch

    import tether

    torch.ones(1, device="cuda")  # this process has initialized CUDA
    assert torch.cuda.is_initialized()
    tether.spawn(uses_cuda, args=(torch.cuda.device_count(),), nprocs=ranks)
    return f"a CUDA parent started {ranks} zygote children that used CUDA"


class Squares:
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> "object":
        import torch

        return torch.full((8,), float(i * i))


def pool_loader_pins_memory(ranks: int) -> str:
    from torch.utils.data import DataLoader

    import tether

    with tether.Pool(2) as pool:
        loader = DataLoader(
            Squares(),
            batch_size=8,
            num_workers=2,
            pin_memory=True,
            multiprocessing_context=pool.context(),
        )
        batches = list(loader)
    assert len(batches) == 8 and all(b.is_pinned() for b in batches), batches
    assert batches[1][0, 0].item() == 64.0
    return "a pool loader with pin_memory=True gave 8 pinned batches"


CHECKS: List[Tuple[str, Callable[[int], str]]] = [
    ("warm ranks: CUDA and an NCCL all-reduce", warm_ranks_use_nccl),
    ("tether.spawn from a CUDA parent", cuda_parent_spawns_from_the_zygote),
    ("tether.Pool loader, pin_memory=True", pool_loader_pins_memory),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks of checks 1 and 2")
    args = parser.parse_args()
    found = gpus()
    if found == 0:
        print(
            "gpu_check: no GPU on this machine (no /dev/nvidia* device that torch can use): "
            "nothing checked"
        )
        return 0
    ranks = max(1, min(args.ranks, found))
    print(f"gpu_check: {found} GPU(s); {ranks} rank(s) per check")
    failed = 0
    for name, check in CHECKS:
        began = time.monotonic()
        try:
            said = check(ranks)
            print(f"ok      {name} ({time.monotonic() - began:.1f} s): {said}")
        except Exception as exc:  # noqa: BLE001 - every check reports, whatever failed
            failed += 1
            print(f"FAILED  {name}: {type(exc).__name__}: {textwrap.shorten(str(exc), 2000)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
