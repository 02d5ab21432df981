"""The pool worker: its main loop, and the wire format it shares with ``pool.py``.

A worker is started once (a spawn child of the tether supervisor, or a fork) and then
serves message after message from its control socket (one end of a ``_native.Endpoint``
pair; the pool holds the other):

- ``B`` a batch of executor tasks; each result (or exception) goes back in an ``R``
  message, several per message, flushed at the end of the batch or every few milliseconds;
- ``P`` a leased process (``pool.context().Process``, e.g. a DataLoader worker loop): its
  target runs in this process's main thread, then ``D`` reports its exit code;
- end of stream (the pool closed its end): the worker exits.

Before each task it writes the task's id to a shared "progress" word (a memfd page mapped by
both sides), so when a worker dies the pool knows exactly which task it was running, which
ones it finished without reporting, and which it never started (those run elsewhere).

Whatever a task leaves is cleaned up before the next: the channels it received are closed,
torch's DataLoader worker info is reset, the random generators are reseeded, and after a
short idle time the garbage collector runs."""

from __future__ import annotations

import gc
import importlib
import mmap
import os
import random
import struct
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import _channel, _child, _native

# Message kinds (first byte).
BATCH = b"B"
LEASE = b"P"
RESULTS = b"R"
DONE = b"D"
HELLO = b"H"

_COUNT = struct.Struct("<cI")
_TASK = struct.Struct("<QII")  # id, blob length, fd count
_RESULT = struct.Struct("<QBII")  # id, ok, blob length, fd count
_LEASE = struct.Struct("<cQ")
_DONE = struct.Struct("<cQi")
_HELLO = struct.Struct("<cI")

#: A batch's results are sent after each task (so a crash loses no finished result), or,
#: when that is set above 1, every this many tasks or seconds.
FLUSH_COUNT = 1
FLUSH_INTERVAL = 0.002
#: After a message, poll the control socket this long before sleeping (the next task often
#: comes that soon, and a wake-up costs more).
SPIN = 0.0002
#: After a leased process ends, the garbage collector runs once the worker is this idle.
IDLE_GC = 0.2


def encode_batch(items: Sequence[Tuple[int, bytes, Sequence[int]]]) -> Tuple[bytes, List[int]]:
    """``(id, blob, fds)`` per task -> one ``B`` message and its fds."""
    head = [_COUNT.pack(BATCH, len(items))]
    fds: List[int] = []
    for task_id, blob, task_fds in items:
        head.append(_TASK.pack(task_id, len(blob), len(task_fds)))
        fds.extend(task_fds)
    head.extend(blob for _, blob, _ in items)
    return b"".join(head), fds


def _decode(data: bytes, fds: Sequence[int], record: struct.Struct) -> List[Tuple[Any, ...]]:
    """The records of a message made by ``encode_batch`` or ``encode_results``: each
    record's fields but the last two (size, fd count), its bytes and its fds."""
    _, count = _COUNT.unpack_from(data)
    offset = _COUNT.size + count * record.size
    view = memoryview(data)
    out = []
    fd_at = 0
    for n in range(count):
        *fields, size, nfds = record.unpack_from(data, _COUNT.size + n * record.size)
        out.append((*fields, view[offset : offset + size], list(fds[fd_at : fd_at + nfds])))
        offset += size
        fd_at += nfds
    return out


def decode_batch(data: bytes, fds: Sequence[int]) -> List[Tuple[int, memoryview, List[int]]]:
    return _decode(data, fds, _TASK)  # type: ignore[return-value]


def encode_results(
    results: Sequence[Tuple[int, bool, bytes, Sequence[int]]],
) -> Tuple[bytes, List[int]]:
    head = [_COUNT.pack(RESULTS, len(results))]
    fds: List[int] = []
    for task_id, ok, blob, result_fds in results:
        head.append(_RESULT.pack(task_id, ok, len(blob), len(result_fds)))
        fds.extend(result_fds)
    head.extend(r[2] for r in results)
    return b"".join(head), fds


def decode_results(
    data: bytes, fds: Sequence[int]
) -> List[Tuple[int, bool, memoryview, List[int]]]:
    return [(t, bool(ok), blob, f) for t, ok, blob, f in _decode(data, fds, _RESULT)]


def encode_lease(lease_id: int, blob: bytes) -> bytes:
    return _LEASE.pack(LEASE, lease_id) + blob


def decode_done(data: bytes) -> Tuple[int, int]:
    _, lease_id, code = _DONE.unpack_from(data)
    return lease_id, code


class Progress:
    """The id of the task a worker is running (0: none), in a memfd page both sides map."""

    def __init__(self, fd: int) -> None:
        self.fd: Optional[int] = fd
        self._map = mmap.mmap(fd, 8)

    @classmethod
    def create(cls) -> "Progress":
        fd = os.memfd_create("tether-progress", os.MFD_CLOEXEC)
        os.ftruncate(fd, 8)
        return cls(fd)

    def close_fd(self) -> None:
        """Closes the fd (the mapping stays)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self.close_fd()
        self._map.close()

    def set(self, task_id: int) -> None:
        struct.pack_into("<Q", self._map, 0, task_id)

    def get(self) -> int:
        return struct.unpack_from("<Q", self._map, 0)[0]


class TaskUnpicklingError(RuntimeError):
    """A task could not be unpickled in the worker (its error is the ``__cause__``)."""


class ResultPicklingError(RuntimeError):
    """A task's result (or exception) could not be pickled in the worker."""


class _RemoteError(Exception):
    """Stands for an exception that could not be pickled: its type name and message."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name


def _format(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def _pickled_error(exc: BaseException, text: str, collector: _channel._FdCollector) -> bytes:
    try:
        return _channel.dumps((exc, text), collector)
    except BaseException:  # noqa: BLE001 - any failure falls back to a plain description
        return _channel.dumps((_RemoteError(type(exc).__name__, str(exc)), text), collector)


def _run_task(blob: memoryview, fds: List[int]) -> Tuple[bool, Any]:
    """Unpickles and runs one task; ``(True, result)`` or ``(False, (exception, text))``."""
    try:
        fn, args, kwargs = _channel.loads(blob, fds)
    except BaseException as exc:  # noqa: BLE001 - SystemExit while unpickling included
        error = TaskUnpicklingError(
            f"could not unpickle the task in worker (pid {os.getpid()}): {exc!r}"
        )
        error.__cause__ = exc
        text = _format(exc)
        exc.__traceback__ = None
        return False, (error, text)
    try:
        return True, fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - the task's SystemExit is its result too
        text = _format(exc)
        exc.__traceback__ = None  # drop the frames (and the task's arguments) now
        return False, (exc, text)


def _dump_result(ok: bool, value: Any) -> Tuple[bool, bytes, List[int], Any]:
    """Pickles a result; returns ``(ok, blob, fds, keep)`` where ``keep`` holds what the fds
    belong to until the message is sent."""
    collector = _channel._FdCollector()
    try:
        if ok:
            return True, _channel.dumps(value, collector), collector.fds, value
        return False, _pickled_error(value[0], value[1], collector), collector.fds, value
    except BaseException as exc:  # noqa: BLE001 - SystemExit in a __reduce__ included
        error = ResultPicklingError(
            f"could not pickle the result of the task in worker (pid {os.getpid()}): {exc!r}"
        )
        collector = _channel._FdCollector()
        return False, _pickled_error(error, _format(exc), collector), collector.fds, None


def _run_batch(ctl: Any, progress: Progress, data: bytes, fds: List[int]) -> None:
    out: List[Tuple[int, bool, bytes, Sequence[int]]] = []
    keep: List[Any] = []
    last_flush = time.monotonic()
    _channel.begin_task_scope()
    for task_id, blob, task_fds in decode_batch(data, fds):
        progress.set(task_id)
        ok, value = _run_task(blob, task_fds)
        ok, result_blob, result_fds, kept = _dump_result(ok, value)
        del value  # the task's garbage goes now, while this task is still the one "running"
        out.append((task_id, ok, result_blob, result_fds))
        keep.append(kept)
        del kept
        if len(out) >= FLUSH_COUNT or time.monotonic() - last_flush >= FLUSH_INTERVAL:
            # Results go back before the next task starts whenever the batch came from
            # single submits (FLUSH_COUNT 1): a crash then loses no finished result.
            _send(ctl, *encode_results(out))
            out, keep, last_flush = [], [], time.monotonic()
    if out:
        _send(ctl, *encode_results(out))
    del keep
    _channel.end_task_scope()
    progress.set(0)


def _send(ctl: Any, data: bytes, fds: List[int]) -> None:
    ctl.send(data, fds)


def _run_lease(ctl: Any, progress: Progress, data: bytes, fds: List[int]) -> None:
    """Runs a leased process's target as ``multiprocessing.Process.run`` would: exit code 0
    on return, the code of a ``SystemExit``, 1 (with the traceback on stderr) otherwise."""
    _, lease_id = _LEASE.unpack_from(data)
    progress.set(lease_id)
    _channel.begin_task_scope()
    code = 0
    try:
        call: Optional[Tuple[Callable[..., Any], Tuple[Any, ...], Dict[str, Any]]]
        call = _channel.loads(memoryview(data)[_LEASE.size :], fds)
        target, args, kwargs = call  # type: ignore[misc]
        call = None
        try:
            target(*args, **kwargs)
        finally:
            del target, args, kwargs
    except SystemExit as exc:
        code = _child.exit_code(exc)
    except BaseException:  # noqa: BLE001 - as multiprocessing's Process._bootstrap does
        sys.stderr.write(f"Process tether-pool-worker (pid {os.getpid()}):\n")
        traceback.print_exc()
        code = 1
    finally:
        _channel.end_task_scope()
        _reset_after_lease()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not kill the worker
                pass
    ctl.send(_DONE.pack(DONE, lease_id, code))
    progress.set(0)


def _reset_after_lease() -> None:
    """What a DataLoader worker loop leaves behind that the next task must not see."""
    worker = sys.modules.get("torch.utils.data._utils.worker")
    if worker is not None:
        worker._worker_info = None  # type: ignore[attr-defined]
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


def serve(slot: int, ctl_fd: int, progress_fd: int, config: Dict[str, Any]) -> None:
    """The worker's main loop (called by tether's child bootstrap as ``fn(rank, *args)``)."""
    ctl = _native.Endpoint.from_fd(ctl_fd)
    progress = Progress(progress_fd)
    progress.close_fd()
    for name in config.get("preload") or ():
        importlib.import_module(name)
    initializer = config.get("initializer")
    if initializer is not None:
        initializer(*config.get("initargs", ()))
    ctl.send(_HELLO.pack(HELLO, os.getpid()))
    idle_gc = False
    while True:
        try:
            got = ctl.recv(IDLE_GC if idle_gc else None, spin=SPIN)
        except EOFError:
            return
        if got is None:
            gc.collect()
            idle_gc = False
            continue
        data, fds = got
        kind = data[:1]
        if kind == BATCH:
            _run_batch(ctl, progress, data, fds)
        elif kind == LEASE:
            _run_lease(ctl, progress, data, fds)
            idle_gc = True
        else:
            _channel._close_all(fds)
            return
        del data, fds, got
