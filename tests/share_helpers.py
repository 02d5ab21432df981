"""Functions and datasets for the tests of ``tether.share``, importable by name in workers and
ranks. It imports no torch (only a DataLoader's worker loop does)."""

from __future__ import annotations

import multiprocessing.forkserver
import multiprocessing.util
import os
from typing import Any, Dict, List, Set, Tuple

#: Every process of a test saves what it maps under this name (see ``mapped``).
MEMFD = "memfd:tether.share"


def mapped(_: Any = None) -> Set[int]:
    """The inodes of the tether.share memfds this process maps (``/proc/self/maps``): two
    processes that map the same inode read the same pages."""
    inodes = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/" + MEMFD):
                inodes.add(int(fields[4]))
    return inodes


def mapping_of(inode: int) -> List[Dict[str, Any]]:
    """The mappings of memfd ``inode`` in this process: their permissions and their
    ``/proc/self/smaps`` counters (kB)."""
    found: List[Dict[str, Any]] = []
    ours = False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
                ours = int(fields[4]) == inode and MEMFD in line
                if ours:
                    found.append({"perms": fields[1]})
            elif ours and fields[0].endswith(":") and len(fields) == 3:
                found[-1][fields[0][:-1]] = int(fields[1])
    return found


def sample(i: int) -> Tuple[str, int]:
    """Sample ``i`` of an ImageFolder-like list over ImageNet's train set."""
    return (f"/data/imagenet/train/n{i // 1300:08d}/n{i // 1300:08d}_{i}.JPEG", i // 1300)


def samples(n: int) -> List[Tuple[str, int]]:
    return [sample(i) for i in range(n)]


class Folder:
    """A map-style dataset over ``samples``, as torchvision's ImageFolder holds them; an
    item is its index, checked against the sample it reads, and where it was read (the
    worker's pid, the memfds it maps)."""

    def __init__(self, items: Any, report: bool = True) -> None:
        self.samples = items
        self.report = report

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Any:
        if self.samples[i] != sample(i):
            raise AssertionError(f"sample {i} reads {self.samples[i]!r}")
        return (i, os.getpid(), frozenset(mapped())) if self.report else i


def collate_indexes(batch: List[int]) -> Any:
    """A batch of indexes as one small tensor (cheap to send back)."""
    import torch

    return torch.tensor(batch)


def collate_list(batch: List[Any]) -> List[Any]:
    return batch


def length_and_mapped(shared: Any) -> Tuple[int, Set[int]]:
    return len(shared), mapped()


def rank_reports(rank: int, shared: Any, queue: Any) -> None:
    """A ``tether.spawn`` rank: what it maps, and that it reads the items."""
    queue.put((rank, mapped(), list(shared[:3]), len(shared)))


def rank_builds(rank: int, key: str, log: str, queue: Any) -> None:
    """A ``tether.spawn`` rank of the key form: each ``build()`` call is a line of ``log``."""
    import tether

    def build() -> List[Tuple[str, int]]:
        with open(log, "a") as f:
            f.write(f"{rank}\n")
        return samples(1000)

    shared = tether.share(build, key=key)
    queue.put((rank, mapped(), len(shared), shared[999]))


def stop_forkserver() -> None:
    """Stops multiprocessing's fork server (it would outlive the test that used it) and
    removes the temporary directory of its socket."""
    multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]
    for finalizer in list(multiprocessing.util._finalizer_registry.values()):  # type: ignore[attr-defined]
        if getattr(finalizer, "_callback", None) is multiprocessing.util._remove_temp_dir:  # type: ignore[attr-defined]
            finalizer()


#: Per process: how many times a ``KeptSamples`` was pickled and unpickled there.
COUNTS = {"pickled": 0, "unpickled": 0}


class KeptSamples:
    """A dataset holding shared samples that counts its picklings to travel (not those that
    only compare it with what was sent) and its unpicklings (per process, in ``COUNTS``);
    item i: ``(pid, unpicklings there, mapped inodes, sample i)``."""

    def __init__(self, items: Any) -> None:
        self.samples = items

    def __getstate__(self) -> Dict[str, Any]:
        from multiprocessing.context import get_spawning_popen

        if get_spawning_popen() is not None:  # pickled to travel
            COUNTS["pickled"] += 1
        return dict(self.__dict__)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        COUNTS["unpickled"] += 1
        self.__dict__.update(state)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Any:
        return os.getpid(), COUNTS["unpickled"], frozenset(mapped()), self.samples[i]
