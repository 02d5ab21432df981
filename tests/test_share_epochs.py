"""Two full epochs over an ImageFolder-sized shared list (1,281,167 ``(path, class)``
samples) with fork, spawn and forkserver DataLoader workers and with a pool's: every sample
is seen once per epoch, and the workers' memory stays flat, where a plain list's pages are
copied into every fork worker as it reads them (torch's copy-on-read)."""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import pytest
import share_helpers as helpers
from torch.utils.data import DataLoader

import tether

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

N = 1_281_167
MiB = 2**20


@pytest.fixture(scope="module")
def shared_samples():
    return tether.share(helpers.samples(N))


def memory(pids: List[int]) -> Dict[str, int]:
    """The workers' summed PSS (anonymous and shared memory, not the files they map) and
    anonymous PSS, in bytes."""
    total = {"pss": 0, "anon": 0}
    for pid in pids:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if "kB" in line}
        total["pss"] += fields["Pss_Anon"] + fields["Pss_Shmem"]
        total["anon"] += fields["Pss_Anon"]
    return total


def two_epochs(loader: Any, workers: Any) -> List[Dict[str, int]]:
    """Runs two epochs, checking that each sees every sample once; the workers' memory after
    the first batch and after each epoch."""
    measured = []
    for _ in range(2):
        seen = np.zeros(N, dtype=np.int32)
        for batch in loader:
            seen[batch.numpy()] += 1
            if not measured:
                measured.append(memory(workers()))
        assert seen.min() == 1 and seen.max() == 1
        measured.append(memory(workers()))
    return measured


def loader(samples: Any, context: Any, persistent: bool) -> DataLoader:
    return DataLoader(
        helpers.Folder(samples, report=False),
        batch_size=4096,
        shuffle=True,
        num_workers=2,
        persistent_workers=persistent,
        multiprocessing_context=context,
        collate_fn=helpers.collate_indexes,
    )


def assert_flat(measured: List[Dict[str, int]]) -> None:
    first, epoch1, epoch2 = measured
    # Reading copies nothing: the anonymous memory does not grow with what is read, and
    # nothing grows from one epoch to the next (the shared pages are mapped by then).
    assert epoch2["anon"] - first["anon"] < 30 * MiB, measured
    assert epoch2["pss"] - epoch1["pss"] < 10 * MiB, measured


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_two_epochs_of_dataloader_workers_see_every_sample_once_with_flat_memory(
    shared_samples, method
):
    data = loader(shared_samples, method, persistent=True)
    try:
        measured = two_epochs(data, lambda: [w.pid for w in data._iterator._workers])
    finally:
        data._iterator = None  # its workers exit
        if method == "forkserver":
            helpers.stop_forkserver()
    assert_flat(measured)


def test_two_epochs_of_pool_workers_see_every_sample_once_with_flat_memory(shared_samples):
    with tether.Pool(2) as pool:
        data = loader(shared_samples, pool.context(), persistent=False)
        measured = two_epochs(data, pool.pids)
    assert_flat(measured)
