"""How a DataLoader's dataset, ``collate_fn`` and ``worker_init_fn`` cross to the pool's
workers, and what a worker keeps of them (``_kept``, keyed by the parent's object; the
parent's record of it is ``datasets.Kept``).

When an object must cross, the loader's three objects are pickled together (what they share
stays shared, as in torch's one pickle of a worker's arguments), once per loader, not once
per worker: a ``Shipment`` is one pickle stream (inline when small, else in a sealed memfd)
whose large buffers (numpy arrays, anything offering protocol 5's out-of-band buffers) lie
page-aligned in a second sealed memfd. Every worker of the loader maps both and unpickles
at the same time as the others; the buffers are not copied into any worker (a worker
maps them copy-on-write, as a fork would share them; so does a tensor's storage: see
``storages``). Functions and classes that an import by name would not give as the parent
has them (``__main__``'s, lambdas, local ones) travel by value, with the values of the
globals their code reads (``pickling``'s ``as_fork``). An object a worker holds already
travels as a ``Held`` reference of a few bytes.

A worker keeps the bytes it was sent with its copy (``_Copy``): each lease starts from the
objects as the parent sent them. What a lease did to the copy (a ``worker_init_fn`` that
narrows an ``IterableDataset`` to its shard, a ``__getitem__`` that caches) is undone by
making the copy again from the bytes, right after the lease, unless a snapshot of the copy
(``snapshot``) proves it unchanged; the parent does no work for it. The bytes cost the
worker what the pickle takes (a memfd's pages are shared by the workers that keep them).

The next lease needs no new proof of a copy when nothing but the worker's own loop can
have run since it was proven (see ``trust``)."""

from __future__ import annotations

import fcntl
import io
import mmap
import os
import pickle
import weakref
from multiprocessing.reduction import DupFd
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from tether.common import pickling

from . import shm, storages, trust
from .snapshot import Snapshot, pages

__all__ = ["Forgetting", "Held", "Shipment", "settle"]

#: A pickle stream up to this size travels inside the lease's message.
INLINE = 1 << 20
#: Buffers at least this large travel out of band.
OUT_OF_BAND = 1 << 16
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
_PAGE = mmap.PAGESIZE


# -- the worker's side ------------------------------------------------------------------------


class _Copy:
    """What a worker keeps of a shipment: the bytes it was sent (the pickle stream, inline
    or a sealed memfd; the memfd of its out-of-band buffers; the fds its objects named),
    the copy of the objects it made from them, and a snapshot of that copy as it was made.
    Before each use the copy is checked against the snapshot: a copy that may have changed
    (a ``worker_init_fn`` narrowed it, ``__getitem__`` or ``__iter__`` wrote to it) is made
    again from the bytes, so that every lease starts from the objects as the parent sent
    them."""

    def __init__(
        self,
        stream: Any,
        size: int,
        buffers: Optional[int],
        layout: Sequence[Tuple[int, int]],
        fds: List[int],
    ) -> None:
        self.stream = stream
        self.size = size
        self.buffers = buffers
        self.layout = layout
        self.fds = fds
        self.keys: Set[int] = set()
        #: The key of each object (None: not kept).
        self.keys_at: List[Optional[int]] = []
        #: The indices of the objects the parent dropped (the others are still kept).
        self.dropped: Set[int] = set()
        self.objects: Tuple[Any, ...] = ()
        self.snapshot = Snapshot(None)
        #: The epoch in which the copy was last proven as sent.
        self.proven = -1

    def build(self) -> Tuple[Any, ...]:
        """A new copy of the objects, from the bytes."""
        self.objects, self.snapshot, self.proven = (), Snapshot(None), -1
        owned = [os.dup(fd) for fd in self.fds]
        objects = _unpickle(self.stream, self.size, self.buffers, self.layout, owned)
        trust.touched()  # unpickling runs the objects' own code
        self._keep(objects)
        return objects

    def _keep(self, objects: Tuple[Any, ...]) -> None:
        self.objects = tuple(None if i in self.dropped else o for i, o in enumerate(objects))
        self.snapshot = Snapshot.take(self.objects)

    def drop(self, key: int) -> None:
        """The parent dropped the object of ``key``: so does the copy (unless another object
        of the copy refers to it)."""
        self.keys.discard(key)
        self.dropped.update(i for i, k in enumerate(self.keys_at) if k == key)
        self._keep(self.fresh())  # proven as sent, or made again, before the new snapshot

    def fresh(self) -> Tuple[Any, ...]:
        """The copy, made again first unless it is proven unchanged: by its snapshot, or by
        the proof of this epoch when nothing else can have run since (see ``trust``)."""
        if trust.holds(self.proven):
            return self.objects
        if not self.snapshot.same(self.objects):
            self.build()
        self.proven = trust.epoch
        return self.objects

    def close(self) -> None:
        self.objects = ()
        owned = [*self.fds, *(fd for fd in (self.buffers,) if fd is not None)]
        if not isinstance(self.stream, bytes):
            owned.append(self.stream)
        self.fds, self.buffers, self.stream = [], None, b""
        for fd in owned:
            os.close(fd)


#: What this worker holds: key -> (the copy, the index of the object in it, whether the key
#: is that object's ``__self__``: the object of a bound method).
_kept: Dict[int, Tuple[_Copy, int, bool]] = {}
#: The copies the lease under way used (see ``settle``).
_used: Dict[int, _Copy] = {}


def _forget(keys: Sequence[int]) -> None:
    """Drops the objects the parent no longer holds."""
    for key in keys:
        held = _kept.pop(key, None)
        if held is None:
            continue
        trust.touched()  # what goes may run finalizers
        copy = held[0]
        if copy.keys == {key}:
            _used.pop(id(copy), None)
            copy.close()
        else:
            copy.drop(key)


def _held(key: int, method: Optional[str] = None) -> Any:
    """An object this worker received in an earlier lease (or its bound ``method``), as the
    parent sent it."""
    try:
        copy, index, self_of = _kept[key]
    except KeyError:
        raise LookupError(
            f"tether.Pool worker (pid {os.getpid()}) was sent a reference to object {key}, "
            "which it does not hold"
        ) from None
    _used[id(copy)] = copy
    obj = copy.fresh()[index]
    if self_of:
        obj = obj.__self__
    return obj if method is None else getattr(obj, method)


def settle(idle: bool = False) -> None:
    """After a lease: makes again, while the worker is idle, the copies the lease may have
    changed, so that the next loader does not wait for it. A copy that fails to build is
    built again when next used (and reports its error then). With ``idle`` (the worker is
    idle, its garbage collected), every copy is proven again. Then whether the next lease
    may trust these proofs is decided (``trust.decide``)."""
    if idle:
        copies = list({id(copy): copy for copy, _, _ in _kept.values()}.values())
    else:
        trust.touched()  # the lease ran
        copies = list(_used.values())
        _used.clear()
    for copy in copies:
        if copy.keys:
            try:
                copy.fresh()
            except Exception:  # noqa: BLE001 - reported by the lease that uses it
                copy.objects, copy.snapshot, copy.proven = (), Snapshot(None), -1
    trust.decide()


def _part(bundle: Tuple[Any, ...], index: int) -> Any:
    return bundle[index]


def _map(fd: int, size: int, writable: bool) -> mmap.mmap:
    if writable:  # copy-on-write: what the worker writes stays its own, as after a fork
        return mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)


def _unpickle(
    stream: Any,
    size: int,
    buffers: Optional[int],
    layout: Sequence[Tuple[int, int]],
    owned: List[int],
) -> Tuple[Any, ...]:
    """Unpickles a shipment's bytes (``stream``: bytes, or the fd of a memfd; ``buffers``:
    the fd of the out-of-band buffers' memfd); ``owned`` are fds the objects claim."""
    data: Any = stream
    mapped = None
    if not isinstance(stream, bytes):
        mapped = _map(stream, size, writable=False)
        data = memoryview(mapped)
    views: List[memoryview] = []
    if buffers is not None:
        mapping = _map(buffers, layout[-1][0] + layout[-1][1], writable=True)
        pages.register_private(mapping)  # what the worker writes there, it can tell
        whole = memoryview(mapping)
        views = [whole[offset : offset + length] for offset, length in layout]
        del whole, mapping
    try:
        with storages.mapping():
            bundle: Tuple[Any, ...] = pickling.loads(data, owned, views)
    finally:
        if mapped is not None:
            data.release()
            mapped.close()
    return bundle


def _received(
    keys: Sequence[Tuple[Optional[int], Optional[str]]],
    stream: Any,
    size: int,
    buffers: Any,
    layout: Sequence[Tuple[int, int]],
    fds: Sequence[Any],
) -> Tuple[Any, ...]:
    """Unpickles a shipment (see ``Shipment``): the loader's objects, one pickle, so that
    what they share stays shared. When it has objects to keep, the worker keeps the bytes
    too (see ``_Copy``)."""
    owned = [ref.detach() for ref in fds]
    stream = stream if isinstance(stream, bytes) else stream.detach()
    buffers_fd = None if buffers is None else buffers.detach()
    copy = _Copy(stream, size, buffers_fd, layout, owned)
    if all(key is None for key, _ in keys):
        try:
            copy.fds = []  # the objects claim them
            return _unpickle(stream, size, buffers_fd, layout, owned)
        finally:
            copy.close()
    copy.keys_at = [key for key, _ in keys]
    for index, (key, method) in enumerate(keys):
        if key is not None and key not in copy.keys:
            old = _kept.get(key)
            if old is not None:
                _forget([key])
            _kept[key] = (copy, index, method is not None)
            copy.keys.add(key)
    _used[id(copy)] = copy
    objects = copy.build()
    return objects


# -- the parent's side ------------------------------------------------------------------------


def _sealed_memfd(name: str, size: int, parts: Sequence[Tuple[int, memoryview]]) -> int:
    """A sealed memfd of ``size`` bytes holding each ``(offset, bytes)`` of ``parts``. The
    pages are allocated first, so that running out of memory is an error, not a SIGBUS."""
    fd = shm.memfd("tether.Pool", name, size, sealing=True)
    try:
        for offset, part in parts:
            done = 0
            while done < part.nbytes:
                done += os.pwrite(fd, part[done:], offset + done)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Shipment:
    """One pickle of a loader's objects (dataset, ``collate_fn``, ``worker_init_fn``,
    together, so that what they share stays shared, as in torch's one pickle of a worker's
    arguments) for every worker of the loader: the stream (bytes, or a sealed memfd when
    large), the out-of-band buffers (one sealed memfd, page-aligned), and the fds the
    objects' reductions named (duplicates owned here). ``keys`` says under which key the
    worker keeps each (none: it keeps nothing; a method name: it keeps the method's
    object). It pickles, inside a lease's message, as the call that rebuilds the objects in
    the worker; ``part(i)`` as the i-th of them."""

    def __init__(
        self, bundle: Tuple[Any, ...], keys: Sequence[Tuple[Optional[int], Optional[str]]]
    ) -> None:
        self.keys = list(keys)
        collector = pickling.FdCollector(dup=True)
        self._closer = weakref.finalize(self, pickling.close_all, collector.fds)
        views: List[memoryview] = []

        def out_of_band(buffer: pickle.PickleBuffer) -> bool:
            try:
                view = buffer.raw()
            except BufferError:  # neither C- nor Fortran-contiguous
                return True
            if view.nbytes < OUT_OF_BAND:
                return True
            views.append(view)
            return False

        what = f"a {type(bundle[0]).__name__}"
        stream = io.BytesIO()
        pickling.dump(
            bundle, collector, stream, out_of_band, as_fork=True, overrides=storages.overrides()
        )
        self.fds = collector.fds
        self.size = stream.getbuffer().nbytes
        self.stream: Any = None
        self.stream_fd: Optional[int] = None
        self.buffers_fd: Optional[int] = None
        self.layout: List[Tuple[int, int]] = []
        if self.size <= INLINE:
            self.stream = stream.getvalue()
        else:
            with stream.getbuffer() as view:
                self.stream_fd = self._own(_sealed_memfd(what, self.size, [(0, view)]))
        del stream
        if views:
            offset = 0
            for view in views:
                self.layout.append((offset, view.nbytes))
                offset += -(-view.nbytes // _PAGE) * _PAGE
            end = self.layout[-1][0] + self.layout[-1][1]
            fd = _sealed_memfd(
                f"the buffers of {what}", end, list(zip((o for o, _ in self.layout), views))
            )
            self.buffers_fd = self._own(fd)
        for view in views:
            view.release()

    def _own(self, fd: int) -> int:
        self.fds.append(fd)  # closed with the others (it never travels as one of them)
        return fd

    def close(self) -> None:
        self._closer()

    def part(self, index: int) -> "_Part":
        return _Part(self, index)

    def __reduce__(self) -> Tuple[Callable[..., Any], Tuple[Any, ...]]:
        carried = [fd for fd in self.fds if fd not in (self.stream_fd, self.buffers_fd)]
        return _received, (
            self.keys,
            self.stream if self.stream_fd is None else DupFd(self.stream_fd),
            self.size,
            None if self.buffers_fd is None else DupFd(self.buffers_fd),
            self.layout,
            [DupFd(fd) for fd in carried],
        )


class Held:
    """A reference to an object the worker holds (or to its bound method): pickles as the
    lookup."""

    __slots__ = ("key", "method")

    def __init__(self, key: int, method: Optional[str]) -> None:
        self.key = key
        self.method = method

    def __reduce__(self) -> Tuple[Callable[..., Any], Tuple[int, Optional[str]]]:
        return _held, (self.key, self.method)


class _Part:
    """One object of a shipment: the lease's message holds the shipment once (the pickler
    keeps it in its memo), and each part takes its object from it."""

    __slots__ = ("shipment", "index")

    def __init__(self, shipment: Shipment, index: int) -> None:
        self.shipment = shipment
        self.index = index

    def __reduce__(self) -> Tuple[Callable[..., Any], Tuple[Shipment, int]]:
        return _part, (self.shipment, self.index)


class Forgetting:
    """The keys a worker drops: the first item of a lease's message, so that the worker
    drops them while it unpickles the message, before any new object arrives."""

    __slots__ = ("keys",)

    def __init__(self, keys: Sequence[int]) -> None:
        self.keys = list(keys)

    def __reduce__(self) -> Tuple[Callable[[Sequence[int]], None], Tuple[List[int]]]:
        return _forget, (self.keys,)
