"""Every sentence tether says about how a process ended (``tether.common.words``), word for word:
torch's where torch has one, tether's own, the same for the same event, everywhere else."""

from __future__ import annotations

import signal
from typing import Optional

import pytest

from tether.common import words

KILLED = -signal.SIGKILL
SEGV = -signal.SIGSEGV
BUS = -signal.SIGBUS
OOM_HINT = (
    "SIGKILL often means the kernel's OOM killer ended the process (check `dmesg` or the "
    "memory limit)"
)


class Status:
    """What the sentences read of a ``_native.ExitStatus``."""

    def __init__(self, exitcode: Optional[int], core_dumped: bool = False) -> None:
        self.exitcode = exitcode
        self.signal = -exitcode if exitcode is not None and exitcode < 0 else None
        self.core_dumped = core_dumped

    def __str__(self) -> str:
        return "exit status unavailable (reaped outside tether)"


class Death:
    """What the sentences read of a ``_native.WorkerDied``."""

    def __init__(self, pid: int, exitcode: Optional[int]) -> None:
        self.pid = pid
        self.status = Status(exitcode)


@pytest.mark.parametrize(
    "exitcode, said",
    [
        (3, "exited with code 3"),
        (0, "exited with code 0"),
        (KILLED, "was killed by signal SIGKILL (Killed)"),
        (SEGV, "was killed by signal SIGSEGV (Segmentation fault)"),
    ],
)
def test_a_process_ended_in_tethers_words(exitcode, said):
    assert words.ended(exitcode) == said


def test_hints_name_the_oom_killer_and_dev_shm():
    assert words.hint(KILLED) == OOM_HINT
    assert words.hint(BUS) == "SIGBUS often means /dev/shm is too small for shared memory"
    assert words.hint(-signal.SIGTERM) is None
    assert words.hint(1) is None


def test_a_pool_worker_that_crashed_is_named_with_its_pid_its_end_and_a_hint():
    assert words.worker_crashed(Death(12, KILLED), lost=False) == (
        f"tether.Pool worker (pid 12) was killed by signal SIGKILL (Killed) while running "
        f"this task ({OOM_HINT}); the pool started a new worker"
    )
    assert words.worker_crashed(Death(12, 3), lost=True) == (
        "tether.Pool worker (pid 12) exited with code 3 after running this task, before its "
        "result was sent back; the pool started a new worker"
    )


def test_a_pool_worker_whose_status_something_else_took_is_said_as_code_255():
    assert "(pid 12) exited with code 255 while running" in words.worker_crashed(
        Death(12, None), lost=False
    )


def test_a_pool_worker_that_died_while_starting_shows_its_error():
    assert words.worker_not_started(Death(7, 1), None) == (
        "a tether.Pool worker (pid 7) exited with code 1 before it was ready"
    )
    assert words.worker_not_started(Death(7, KILLED), "Traceback ...") == (
        "a tether.Pool worker (pid 7) was killed by signal SIGKILL (Killed) before it was "
        "ready:\nTraceback ..."
    )


def test_an_executor_worker_is_named_as_the_executor_after_cpythons_sentence():
    assert words.worker_crashed(Death(12, 3), lost=False, owner=words.EXECUTOR) == (
        "A process in the process pool was terminated abruptly while the future was running "
        "or pending: tether.ProcessPoolExecutor worker (pid 12) exited with code 3 while "
        "running this task; the pool started a new worker"
    )
    assert words.worker_not_started(Death(7, 1), "Traceback ...", words.EXECUTOR) == (
        "A child process terminated abruptly, the process pool is not usable anymore: a "
        "tether.ProcessPoolExecutor worker (pid 7) exited with code 1 before it was ready:\n"
        "Traceback ..."
    )


def test_a_leased_process_ends_in_the_same_words_as_a_pool_worker():
    assert words.pool_process_ended("PoolProcess-1", 5, KILLED) == (
        "tether.Pool process PoolProcess-1 (pid 5) was killed by signal SIGKILL (Killed)"
    )
    assert words.pool_process_ended("PoolProcess-1", 5, 2) == (
        "tether.Pool process PoolProcess-1 (pid 5) exited with code 2"
    )


def test_a_dataloader_worker_ends_in_torchs_words():
    assert words.dataloader_worker_ended(9, 7) == (
        "DataLoader worker (pid 9) exited unexpectedly with exit code 7. Details are lost due "
        "to multiprocessing. Rerunning with num_workers=0 may give better error trace."
    )
    assert words.dataloader_worker_ended(9, SEGV) == (
        "DataLoader worker (pid 9) is killed by signal: Segmentation fault. "
    )
    assert words.dataloader_worker_ended(9, BUS) == (
        "DataLoader worker (pid 9) is killed by signal: Bus error. It is possible that "
        "dataloader's workers are out of shared memory. Please try to raise your shared "
        "memory limit."
    )


def test_a_spawned_process_ends_in_torchs_words_with_tethers_note():
    assert words.spawn_raised(1, "Traceback\n") == (
        "\n\n-- Process 1 terminated with the following error:\nTraceback\n"
    )
    assert words.spawn_ended(0, Status(123)) == "process 0 terminated with exit code 123"
    assert words.spawn_ended(0, Status(KILLED)) == "process 0 terminated with signal SIGKILL"
    assert words.spawn_note(0, 42, Status(123)) == "process 0 had pid 42"
    assert words.spawn_note(0, 42, Status(-signal.SIGABRT, core_dumped=True)) == (
        "process 0 had pid 42 and dumped core"
    )
    assert words.spawn_note(2, 42, Status(KILLED)) == f"process 2 had pid 42; {OOM_HINT}"
    assert words.signal_name(signal.SIGTERM) == "SIGTERM"
    assert words.signal_name(0) == "<Unknown signal 0>"


def test_a_status_something_else_took_counts_as_neither_success_nor_failure():
    assert words.status_unavailable(0, 42, Status(None)) == (
        "process 0 (pid 42): exit status unavailable (reaped outside tether); it counts as "
        "neither a success nor a failure"
    )
