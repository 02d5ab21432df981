"""A parent whose ``__main__`` imports modules of tether beyond ``import tether`` (run with
``python -X importtime``): between the two marks on stderr, forkserver children run that
``__main__`` again; whatever they had to import themselves is printed there."""

import sys

import tether
from tether import Pool  # noqa: F401 - imported for the children to find
from tether.zygote import client  # noqa: F401 - imported for the children to find


def nothing(i):
    pass


if __name__ == "__main__":
    tether.start_processes(nothing, nprocs=1, start_method="forkserver")  # starts the zygote
    print("-- children start", file=sys.stderr, flush=True)
    tether.start_processes(nothing, nprocs=2, start_method="forkserver")
    print("-- children done", file=sys.stderr, flush=True)
