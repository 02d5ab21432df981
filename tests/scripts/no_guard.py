"""A script that forgets the `if __name__ == "__main__":` guard: the child must fail clearly
instead of starting processes of its own."""

import tether


def work(i):
    pass


tether.start_processes(work, nprocs=1, start_method="spawn")
print("parent done")
