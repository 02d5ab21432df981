"""Every sentence tether says in Python about how a process ended, fed by the exit status's
own facts (its code or signal, whether it dumped core; ``_native.ExitStatus``, whose words
live beside it in tether-core's ``status.rs``). Where torch has a sentence for the event
(spawn's ``ProcessExitedException``, the DataLoader's dead worker), it is torch's, word for
word; everywhere else it is tether's own, the same words for the same event.

An exit code here is in ``multiprocessing``'s convention: the code, or minus the number of
the signal that killed the process."""

from __future__ import annotations

import signal
from typing import Optional

from tether import _native

#: torch's DataLoader, when a worker was killed by SIGBUS.
_SHM_HINT = (
    "It is possible that dataloader's workers are out of shared memory. "
    "Please try to raise your shared memory limit."
)


def signal_name(signum: int) -> str:
    """The signal's name as torch's spawn spells it (``signal.Signals``)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"<Unknown signal {signum}>"


def _description(signum: int) -> Optional[str]:
    """The C library's description of a signal ("Killed"), or None."""
    try:
        return signal.strsignal(signum)
    except ValueError:
        return None


def ended(exitcode: int) -> str:
    """How a process ended, as tether says it after its subject: "was killed by signal
    SIGKILL (Killed)", "exited with code 3"."""
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    description = _description(-exitcode)
    text = f"was killed by signal {_native.signal_name(-exitcode)}"
    return f"{text} ({description})" if description else text


def hint(exitcode: int) -> Optional[str]:
    """What a death by this signal may mean (SIGKILL: the OOM killer; SIGBUS: /dev/shm),
    or None."""
    return _native.signal_hint(-exitcode) if exitcode < 0 else None


def exitcode_of(status: _native.ExitStatus) -> int:
    """A status as ``multiprocessing`` gives it; 255 stands for one that something else
    took (a SIGCHLD set to SIG_IGN)."""
    return 255 if status.exitcode is None else status.exitcode


#: The pool that ``tether.Pool`` is, by the name its messages give it.
POOL = "tether.Pool"
#: ``tether.ProcessPoolExecutor``: its messages open with CPython's sentence for the event.
EXECUTOR = "tether.ProcessPoolExecutor"
#: CPython's ``ProcessPoolExecutor``, when a worker died with a task in hand.
_CPYTHON_CRASHED = (
    "A process in the process pool was terminated abruptly while the future was running or pending"
)
#: CPython's ``ProcessPoolExecutor``, when a worker died (its initializer failed).
_CPYTHON_BROKEN = "A child process terminated abruptly, the process pool is not usable anymore"


def worker_crashed(death: _native.WorkerDied, lost: bool, owner: str = POOL) -> str:
    """A worker of the pool ``owner`` (``POOL`` or ``EXECUTOR``) died with a task in hand
    (``lost``: it had run the task, its result was not sent yet). Every fact of the death
    is at hand here (``WorkerDied``)."""
    pid, exitcode = death.pid, exitcode_of(death.status)
    when = (
        "after running this task, before its result was sent back"
        if lost
        else "while running this task"
    )
    why = hint(exitcode)
    said = (
        f"{owner} worker (pid {pid}) {ended(exitcode)} {when}"
        + (f" ({why})" if why else "")
        + "; the pool started a new worker"
    )
    return f"{_CPYTHON_CRASHED}: {said}" if owner == EXECUTOR else said


def worker_not_started(death: _native.WorkerDied, report: Optional[str], owner: str = POOL) -> str:
    """A worker of the pool ``owner`` died before it was ready; ``report`` is the error it
    wrote."""
    pid, exitcode = death.pid, exitcode_of(death.status)
    message = f"a {owner} worker (pid {pid}) {ended(exitcode)} before it was ready"
    if owner == EXECUTOR:
        message = f"{_CPYTHON_BROKEN}: {message}"
    return message + (":\n" + report if report is not None else "")


def main_not_guarded(owner: str, where: str, line: str) -> str:
    """A worker of the pool ``owner``, importing the main script, reached the start of the
    pool at ``where`` (``file:line``, whose text is ``line``)."""
    code = f" (`{line}`)" if line else ""
    shown = line or "..."
    return (
        f"the main script starts {owner}'s workers when it is imported, at {where}{code}: "
        "every worker imports the main script to find its functions (as 'spawn' and "
        "'forkserver' children do) and would start them again. Start them under the main "
        f'guard:\n\n    if __name__ == "__main__":\n        {shown}\n        ...\n'
    )


def main_not_guarded_here(said: str) -> str:
    """The process starting a pool saw that its workers would start it again (see
    ``main_not_guarded``)."""
    return f"{said}\n(seen in this process, before any worker started)"


def main_not_guarded_in_worker(death: _native.WorkerDied, said: str, owner: str = POOL) -> str:
    """A worker of the pool ``owner`` stopped importing the main script with ``said`` (see
    ``main_not_guarded``)."""
    message = f"{said}\n(worker pid {death.pid} stopped there)"
    return f"{_CPYTHON_BROKEN}: {message}" if owner == EXECUTOR else message


def pool_process_ended(name: str, pid: int, exitcode: int) -> str:
    """A process leased from a pool (not a DataLoader's worker) ended badly."""
    return f"tether.Pool process {name} (pid {pid}) {ended(exitcode)}"


def dataloader_worker_ended(pid: int, exitcode: int) -> str:
    """A DataLoader's worker ended badly: torch's words."""
    if exitcode >= 0:
        return (
            f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {exitcode}. "
            "Details are lost due to multiprocessing. Rerunning with num_workers=0 may "
            "give better error trace."
        )
    description = _description(-exitcode) or f"signal {-exitcode}"
    message = f"DataLoader worker (pid {pid}) is killed by signal: {description}. "
    return message + (_SHM_HINT if -exitcode == signal.SIGBUS else "")


def spawn_raised(index: int, text: str) -> str:
    """A spawned process raised: torch's words, then the child's traceback ``text``."""
    return f"\n\n-- Process {index} terminated with the following error:\n{text}"


def spawn_ended(index: int, status: _native.ExitStatus) -> str:
    """A spawned process failed without an error report: torch's words."""
    if status.signal is not None:
        return f"process {index} terminated with signal {signal_name(status.signal)}"
    return f"process {index} terminated with exit code {status.exitcode}"


def spawn_note(index: int, pid: int, status: _native.ExitStatus) -> str:
    """tether's note on such an error: the pid, a core dump, a hint."""
    note = f"process {index} had pid {pid}"
    if status.core_dumped:
        note += " and dumped core"
    why = None if status.signal is None else _native.signal_hint(status.signal)
    return f"{note}; {why}" if why else note


def status_unavailable(index: int, pid: int, status: _native.ExitStatus) -> str:
    """A spawned process whose status something else took."""
    return f"process {index} (pid {pid}): {status}; it counts as neither a success nor a failure"


def who(rank: int, pid: int) -> str:
    """A process of a job: "rank 2 (pid 4242)", or "the process of pid 4242" without a
    rank."""
    return f"rank {rank} (pid {pid})" if rank >= 0 else f"the process of pid {pid}"


def share_builder_died(key: str, rank: int, pid: int, exitcode: Optional[int], me: str) -> str:
    """The process building a shared key ended before it was done; ``me`` builds instead.
    ``exitcode`` is None when its status was collected already."""
    how = ended(exitcode) if exitcode is not None else "ended"
    why = hint(exitcode) if exitcode is not None else None
    return (
        f"tether.share(key={key!r}): {who(rank, pid)}, which was building it, {how} before "
        f"it was done" + (f"; {why}" if why else "") + f". {me} builds it instead"
    )
