"""The pool worker: its main loop, and what its tasks and results hold.

A worker is started once (a zygote fork, a spawn child or a fork) and then serves message
after message from its link to the pool (``_native.WorkerEnd``, whose wire format lives in
Rust): a batch of executor tasks, a leased process (``pool.context().Process``, e.g. a
DataLoader's worker loop), or a note (pickled bytes whose unpickling does what the pool
asks: drop the objects the parent dropped). It exits when the pool closes the link.

Before each task it claims the task in the gate it shares with the pool: a task the pool
cancelled meanwhile is skipped, and when the worker dies the pool knows which task (and
which item of a ``map`` chunk) it was running.

A task's bytes unpickle to one of:

- ``(CALL, fn, args, kwargs)``: its result is ``fn(*args, **kwargs)``;
- ``(CHUNK, fn, calls)``: items of a ``map``; its result is a list with one entry per item,
  ``(True, value)`` or ``(False, error)``; when that list does not pickle whole, each entry
  is pickled on its own (``pickling.Nested``, with the message's fds): an entry that does
  not pickle becomes its pickling error, the others keep their results.

An error (an exception raised by the task, or met while unpickling the task or pickling
its result) travels as a ``reports.Described`` (type name, message, traceback text,
pickled exception), so that the pool can rebuild the exception, or describe it when it
cannot cross; one met while unpickling the task travels in an ``Unread``: that task never
ran.

Whatever a task leaves is cleaned up before the next: the channels it received are closed,
torch's DataLoader worker info is reset, the garbage a lease or a batch of tasks left in
the young generations is freed, and after a short idle time the garbage collector runs in
full and the batch storages kept for the next lease go. The random generators a leased
process seeded are reseeded before the next task that does not seed them itself (an
executor task, a process other than torch's DataLoader worker loop), or once the worker is
idle: reseeding torch and numpy costs a few hundred microseconds, which a DataLoader
started right after would otherwise wait for."""

from __future__ import annotations

import gc
import importlib
import logging
import os
import random
import sys
import traceback
from typing import Any, Callable, Dict, Final, List, NamedTuple, Optional, Sequence, Tuple

from tether import _native
from tether.common import pickling, reports
from tether.spawn import bootstrap

from . import channel, recycle, shipment, shm, trust

#: What a task's bytes hold (see the module's documentation).
CALL = 0
CHUNK = 1
#: Result kinds of ``WorkerEnd.send_results``.
ResultKind = _native.ResultKind
OK: Final = ResultKind.OK
ERROR: Final = ResultKind.ERROR
SKIPPED: Final = ResultKind.SKIPPED
#: After a leased process ends, the garbage collector runs once the worker is this idle.
IDLE_GC = 0.2

#: Whether a leased process left the random generators seeded as it chose.
_seeded_by_lease = False


class Unread(NamedTuple):
    """The outcome of a task this worker could not unpickle (it never ran): the error."""

    error: reports.Described


def describe(exc: BaseException) -> reports.Described:
    """``exc`` as it travels to the pool (``reports.describe``, pickled by tether's own
    pickler, as the task's result would be); its frames are let go here, and what their
    locals hold with them."""
    described = reports.describe(exc, lambda e: pickling.dumps(e, pickling.FdCollector()))
    exc.__traceback__ = None
    return described


def _call(fn: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any]) -> Tuple[bool, Any]:
    try:
        return True, fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - the task's SystemExit is its result too
        return False, describe(exc)


def _run_chunk(end: _native.WorkerEnd, fn: Callable[..., Any], calls: Sequence[Any]) -> List[Any]:
    out = []
    for index, args in enumerate(calls):
        if index:
            end.step(index)
        out.append(_call(fn, args, {}))
    return out


def _dump(value: Any, collector: pickling.FdCollector) -> bytes:
    return pickling.dumps(value, collector)


def _dump_entries(entries: List[Any]) -> Tuple[bytes, pickling.FdCollector]:
    """A chunk's entries, pickled whole, or else one by one, each with the fds it names (an
    entry that does not pickle becomes its pickling error)."""
    collector = pickling.FdCollector()
    try:
        return _dump(entries, collector), collector
    except BaseException:  # noqa: BLE001 - SystemExit in a __reduce__ included
        pass
    collector = pickling.FdCollector()
    single = []
    for ok, value in entries:
        try:
            data = _dump((ok, value), collector)
        except BaseException as exc:  # noqa: BLE001
            data = _dump((False, describe(exc)), collector)
        single.append(pickling.Nested(data))
    return _dump(single, collector), collector


def _run_task(
    end: _native.WorkerEnd, blob: bytes, fds: List[int]
) -> Tuple[ResultKind, bytes, List[int], Any]:
    """Unpickles and runs one task; ``(kind, bytes, fds, keep)`` where ``keep`` holds the
    task, its result and what owns the fds until the result is sent: the result goes back
    before anything of the task is freed (a finalizer that kills the worker loses no
    result)."""
    try:
        task = pickling.loads(blob, fds)
    except BaseException as exc:  # noqa: BLE001 - SystemExit while unpickling included
        return ERROR, _dump(Unread(describe(exc)), pickling.FdCollector()), [], None
    shm.install()
    if task[0] == CHUNK:
        entries = _run_chunk(end, task[1], task[2])
        data, collector = _dump_entries(entries)
        return OK, data, collector.fds, (task, entries)
    ok, value = _call(task[1], task[2], task[3])
    collector = pickling.FdCollector()
    try:
        data = _dump(value, collector)
    except BaseException as exc:  # noqa: BLE001 - SystemExit in a __reduce__ included
        return ERROR, _dump(describe(exc), pickling.FdCollector()), [], (task, value)
    return (OK if ok else ERROR), data, collector.fds, (task, value)


def _run_batch(
    end: _native.WorkerEnd, tasks: List[_native.IncomingTask], left: Optional[int]
) -> int:
    """Runs a batch, at most ``left`` tasks of it when that is not None (the tasks not
    started go back to the pool when this worker exits); each result goes back before the
    next task starts (so a crash loses no finished result). Returns how many it ran."""
    _reseed_if_needed()
    recycle.drop()  # batch storages are kept for a next lease only
    trust.touched()  # a task may reach what a dataset's copy holds (a module global)
    channel.begin_task_scope()
    ran = 0
    try:
        while tasks and (left is None or ran < left):
            task = tasks.pop(0)
            task_id, seq, blob, fds = task.id, task.seq, task.data, task.fds
            del task
            if not end.start(seq, task_id):
                pickling.close_all(fds)
                end.send_results([_native.Outcome(task_id, SKIPPED, b"")])
                continue
            ran += 1
            kind, data, out_fds, keep = _run_task(end, blob, fds)
            del blob
            end.send_results([_native.Outcome(task_id, kind, data, out_fds)])
            del keep, data
    finally:
        end.idle()
        channel.end_task_scope()
        _collect_young_garbage()
    for left_over in tasks:
        pickling.close_all(left_over.fds)
    return ran


def _run_lease(end: _native.WorkerEnd, lease_id: int, blob: bytes, fds: List[int]) -> None:
    """Runs a leased process's target as ``multiprocessing.Process.run`` would: exit code 0
    on return, the code of a ``SystemExit``, 1 (with the traceback on stderr) otherwise.
    The call is ``(forgetting, target, args, kwargs, seeds)``: ``forgetting`` drops, as
    it unpickles, what the pool no longer holds (see ``datasets``); ``seeds`` tells whether
    the target seeds the random generators itself (torch's DataLoader worker loop does)."""
    global _seeded_by_lease
    channel.begin_task_scope()
    code = 0
    try:
        call: Optional[Tuple[None, Callable[..., Any], Tuple[Any, ...], Dict[str, Any], bool]]
        call = pickling.loads(blob, fds)
        del blob
        _, target, args, kwargs, seeds = call
        call = None
        shm.install()
        recycle.begin()
        if not seeds:
            _reseed_if_needed()
        try:
            target(*args, **kwargs)
        finally:
            del target, args, kwargs
    except SystemExit as exc:
        code = bootstrap.exit_code(exc)
    except BaseException:  # noqa: BLE001 - as multiprocessing's Process._bootstrap does
        sys.stderr.write(f"Process tether-pool-worker (pid {os.getpid()}):\n")
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not kill the worker
                pass
    try:
        # The process waiting for this one goes on now; what follows is this worker's own.
        end.send_done(lease_id, code)
    finally:
        channel.end_task_scope()
        _reset_after_lease()
        _seeded_by_lease = True
        _collect_young_garbage()
        shipment.settle()


def _act_on(note: bytes) -> None:
    """Unpickles a note from the pool, which does what it says (see ``shipment.Forgetting``);
    what fails is written to stderr, and the worker goes on."""
    try:
        pickling.loads(note, [])
    except Exception:  # noqa: BLE001 - a note must not kill the worker
        sys.stderr.write(f"tether.Pool worker (pid {os.getpid()}): a note from the pool failed:\n")
        traceback.print_exc()


def _collect_young_garbage() -> None:
    """Frees the garbage a lease or a batch of tasks left in the young generations now, so
    that the finalizers of those objects run before the worker proves its copies of
    datasets (which sees what they wrote), not in the middle of the next loader: a new fork
    worker never holds that garbage. Garbage old enough to be in the oldest generation
    waits for the full collection the worker runs once idle (a full collection here would
    walk every item of a big list of the copies: 18 ms for an ImageFolder's); on Python
    3.14, whose collector is incremental, this is one increment of it."""
    gc.collect(1)


def _reset_after_lease() -> None:
    """What a DataLoader worker loop leaves behind that the next task must not see (but
    the seeds: see ``_reseed_if_needed``). The batch storages it kept wait for the next
    lease until the worker is idle (see ``recycle``)."""
    recycle.end()
    worker = sys.modules.get("torch.utils.data._utils.worker")
    if worker is not None:
        # What torch.utils.data.get_worker_info() reads; private, so untyped for mypy.
        worker._worker_info = None  # type: ignore[attr-defined]


def _reseed_if_needed() -> None:
    """Reseeds the random generators a leased process seeded as it chose."""
    global _seeded_by_lease
    if not _seeded_by_lease:
        return
    _seeded_by_lease = False
    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            np.random.seed()
        except Exception:  # noqa: BLE001 - a broken numpy must not kill the worker
            pass
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "seed"):
        try:
            torch.seed()
        except Exception:  # noqa: BLE001
            pass


def _initialize(config: Dict[str, Any]) -> None:
    for name in config.get("preload") or ():
        importlib.import_module(name)
    initializer = config.get("initializer")
    if initializer is None:
        return
    try:
        initializer(*config.get("initargs", ()))
    except BaseException:
        # As concurrent.futures' workers do; the pool then reports the pool as broken.
        logging.getLogger("concurrent.futures").critical("Exception in initializer:", exc_info=True)
        raise


def serve(rank: int, links: Dict[int, _native.WorkerFds], config: Dict[str, Any]) -> None:
    """The worker's main loop (called by tether's child bootstrap as ``fn(rank, *args)``,
    ``rank`` being the worker's slot): ``links[rank]`` are its fds; the others belong to
    workers started alongside. With ``config["max_tasks"]``, it exits after that many
    executor tasks (the pool starts another)."""
    # What this process inherited (all of the parent's heap, for a fork) is never collected
    # here: the finalizers of the parent's garbage must not run in a worker.
    gc.freeze()
    trust.watch_collections()
    for slot, fds in links.items():
        if slot != rank:
            pickling.close_all([fds.ctl, fds.gate])
    end = _native.WorkerEnd(links[rank].ctl, links[rank].gate, config.get("spin", 0.0))
    _initialize(config)
    end.hello(os.getpid())
    idle_gc = False
    left: Optional[int] = config.get("max_tasks")
    while left is None or left > 0:
        try:
            got = end.recv(IDLE_GC if idle_gc else None)
        except EOFError:
            return
        if got is None:
            recycle.drop()
            gc.collect()
            _reseed_if_needed()
            shipment.settle(idle=True)
            idle_gc = False
            continue
        if isinstance(got, _native.TaskBatch):
            tasks = got.tasks
            del got  # each task's bytes go as soon as it ran
            ran = _run_batch(end, tasks, left)
            left = None if left is None else left - ran
            del tasks
        elif isinstance(got, _native.Note):
            _act_on(got.data)
            del got
        else:
            _run_lease(end, got.id, got.data, got.fds)
            idle_gc = True
            del got
