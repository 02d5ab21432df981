"""How a DataLoader's dataset, ``collate_fn`` and ``worker_init_fn`` reach the pool's
workers: once, and then never again while the parent holds them.

torch's worker loop receives these objects with every ``iter(loader)``. On a pool the
workers outlive the iterator, so they keep what they received (``_kept``, keyed by the
parent's object), and a later loader over the same objects sends a reference of a few
bytes instead of the objects. ``Kept`` is the parent's record of it, one per pool:

- each object has a key that is never reused (a new object that takes a freed one's address
  is a new object), a version, and which worker holds which version;
- a version ends unless a snapshot (``snapshot``) proves that pickling the object now
  would give what was sent: any change at any depth of what pickling it takes (an
  attribute rebound, a list, dict or set changed in place, a tensor on a new storage), and
  anything the snapshot cannot prove (past its budget, a type it does not look into), ends
  it, and so does ``refresh`` of the object or of anything it holds; the next loader then
  sends the object again;
- when the parent drops an object, each worker that holds it is told at once to drop its
  copy (``forgotten``: a note the worker reads between leases), or else with its next lease.

When an object must cross (its first loader, a new version, or a context made with
``keep_datasets=False``, which keeps nothing), it travels in the loader's one
``shipment.Shipment``, pickled once per loader, not once per worker."""

from __future__ import annotations

import collections
import itertools
import threading
import types
import weakref
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from tether.common import pickling

from . import shipment
from .snapshot import Snapshot, reaches

__all__ = ["Kept"]

#: The arguments of torch's worker loop that carry objects a worker keeps.
KEPT_ARGUMENTS = ("dataset_holder", "dataset", "collate_fn", "init_fn")


def _carries(name: str, value: Any) -> bool:
    """Whether an argument of torch's worker loop carries an object to keep
    (``dataset_holder`` is a list of one, which the worker loop empties)."""
    if name == "dataset_holder":
        return isinstance(value, list) and len(value) == 1
    return value is not None


class _Entry:
    """An object the workers may hold."""

    __slots__ = ("key", "address", "ref", "version", "snapshot", "holders")

    def __init__(self, key: int, obj: Any) -> None:
        self.key = key
        self.address = id(obj)
        self.ref = weakref.ref(obj)
        self.version = 0
        self.snapshot = Snapshot.take(obj)
        #: slot -> (pid, version) of the worker there that holds the object.
        self.holders: Dict[int, Tuple[int, int]] = {}


class _Element:
    """One of a loader's kept objects as this loader found it: the object, its entry (None
    when it cannot be watched, or nothing is kept), the entry's version, and for a bound
    method the method's name (the entry is then its object's). An object pickled by
    reference (a function or class of a module: a name) is not kept: it travels as itself,
    in a few bytes (``inline``)."""

    __slots__ = ("obj", "entry", "version", "method", "inline")

    def __init__(
        self, obj: Any, entry: Optional[_Entry], method: Optional[str], inline: bool = False
    ) -> None:
        self.obj = obj
        self.entry = entry
        self.version = -1 if entry is None else entry.version
        self.method = method
        self.inline = inline

    def held_by(self, slot: int, pid: int) -> bool:
        if self.inline:
            return True
        return self.entry is not None and self.entry.holders.get(slot) == (pid, self.version)

    def reference(self) -> Any:
        """What the lease of a worker that holds the object carries in its place."""
        if self.inline or self.entry is None:
            return self.obj
        return shipment.Held(self.entry.key, self.method)


def _by_reference(obj: Any) -> bool:
    """Whether pickle saves ``obj`` as its name (then nothing of it is worth keeping)."""
    if type(obj) is types.FunctionType or isinstance(obj, type):
        return not pickling.travels_by_value(obj, as_fork=True)
    return False


class _Iteration:
    """What one DataLoader iterator's leases share: its kept objects, seen once, and their
    shipment, made once."""

    __slots__ = ("elements", "shipment", "__weakref__")

    def __init__(self) -> None:
        self.elements: Optional[List[_Element]] = None
        self.shipment: Optional[shipment.Shipment] = None

    def close(self) -> None:
        if self.shipment is not None:
            self.shipment.close()
        self.shipment = None
        self.elements = None


class Kept:
    """A pool's record of the objects its workers hold (see the module's documentation)."""

    def __init__(self, wake: Callable[[], None] = lambda: None) -> None:
        #: Called when an object the workers may hold is gone (from its finalizer: it must
        #: neither block nor take a lock of ours); ``forgotten`` is then called soon.
        self._wake = wake
        self._lock = threading.Lock()
        self._keys = itertools.count(1)
        self._entries: Dict[int, _Entry] = {}
        #: Entries whose object is gone; appended by finalizers (which never take the lock).
        self._dropped: Deque[_Entry] = collections.deque()
        #: slot -> keys its worker is to drop (sent by ``forgotten``, or with its next lease).
        self._forget: Dict[int, List[int]] = {}
        self._iterations: "weakref.WeakKeyDictionary[Any, _Iteration]" = weakref.WeakKeyDictionary()

    def prepare(
        self, call: Dict[str, Any], slot: int, pid: int, keep: bool
    ) -> Tuple[Dict[str, Any], shipment.Forgetting, Callable[[], None]]:
        """torch's worker-loop ``call`` (its arguments by name) as worker ``pid`` in ``slot``
        gets it: the kept objects replaced by references to the worker's copies when it
        holds them all, else by the parts of the loader's shipment; the keys it drops; and
        what to record once the lease is sent."""
        names = [name for name in KEPT_ARGUMENTS if _carries(name, call.get(name))]
        objs = [call[name][0] if name == "dataset_holder" else call[name] for name in names]
        with self._lock:
            self._collect_dropped()
            done_event = call.get("done_event")
            iteration = self._iterations.get(done_event) if done_event is not None else None
            if iteration is None:
                iteration = _Iteration()
                if done_event is not None:
                    self._iterations[done_event] = iteration
            if iteration.elements is None:
                iteration.elements = [self._element(obj, keep) for obj in objs]
            elements = iteration.elements
            sent: List[_Element] = []
            if keep and all(e.held_by(slot, pid) for e in elements):
                refs: List[Any] = [e.reference() for e in elements]
            else:
                if iteration.shipment is None:
                    keys = [(None if e.entry is None else e.entry.key, e.method) for e in elements]
                    iteration.shipment = shipment.Shipment(tuple(objs), keys)
                refs = [iteration.shipment.part(i) for i in range(len(objs))]
                sent = [e for e in elements if e.entry is not None]
            out = dict(call)
            for name, ref in zip(names, refs):
                out[name] = [ref] if name == "dataset_holder" else ref
            forget = shipment.Forgetting(self._forget.get(slot, ()))
            last = call.get("worker_id") == call.get("num_workers", 0) - 1

        def commit() -> None:
            with self._lock:
                for element in sent:
                    if element.entry is not None:
                        element.entry.holders[slot] = (pid, element.version)
                keys = set(forget.keys)
                left = [key for key in self._forget.pop(slot, ()) if key not in keys]
                if left:
                    self._forget[slot] = left
                if last and done_event is not None:
                    # The loader's last worker has what it needs: the shipment goes.
                    done = self._iterations.pop(done_event, None)
                    if done is not None:
                        done.close()

        return out, forget, commit

    def _element(self, obj: Any, keep: bool) -> _Element:
        """``obj`` as this loader finds it. A bound method is watched through its object
        (a new bound method is made at every attribute access: ``collate_fn=ds.collate``)."""
        if not keep:
            return _Element(obj, None, None)
        if _by_reference(obj):
            return _Element(obj, None, None, inline=True)
        if isinstance(obj, types.MethodType):
            name = getattr(obj, "__name__", None)
            target = obj.__self__
            if isinstance(name, str) and getattr(target, name, None) == obj:
                return _Element(obj, self._entry(target), name)
            return _Element(obj, None, None)
        return _Element(obj, self._entry(obj), None)

    def _entry(self, obj: Any) -> Optional[_Entry]:
        """``obj``'s entry, made now or with a new version when it changed; None for an
        object that cannot be watched (no weak reference: a plain list, say), which is
        sent with every loader."""
        entry = self._entries.get(id(obj))
        if entry is not None and entry.ref() is obj:
            if not entry.snapshot.same(obj):
                entry.version += 1
                entry.snapshot = Snapshot.take(obj)
            return entry
        try:
            entry = _Entry(next(self._keys), obj)
            weakref.finalize(obj, self._gone, entry)
        except TypeError:
            return None
        self._entries[entry.address] = entry
        return entry

    def _gone(self, entry: _Entry) -> None:
        """``entry``'s object is gone (a finalizer: it never takes the lock)."""
        entry.snapshot = Snapshot(None)  # what it held or watched goes now
        self._dropped.append(entry)
        self._wake()

    def _collect_dropped(self) -> None:
        while self._dropped:
            entry = self._dropped.popleft()
            if self._entries.get(entry.address) is entry:
                del self._entries[entry.address]
            entry.snapshot = Snapshot(None)
            for slot in entry.holders:
                self._forget.setdefault(slot, []).append(entry.key)

    def forgotten(self) -> Dict[int, List[int]]:
        """The keys each worker is to drop now (slot -> keys), taken from what its next
        lease would carry; ``forget_later`` gives back those a worker could not be told."""
        if not self._dropped and not self._forget:
            return {}  # the hub asks after every event: most of them find nothing
        with self._lock:
            self._collect_dropped()
            forget, self._forget = self._forget, {}
        return forget

    def forget_later(self, slot: int, keys: List[int]) -> None:
        """The worker in ``slot`` is told to drop ``keys`` with its next lease."""
        with self._lock:
            self._forget.setdefault(slot, []).extend(keys)

    def send_again(self, obj: Any = None) -> None:
        """The next loader sends again every kept object that holds ``obj`` (is it, or
        reaches it at any depth of what pickling it takes: a ``Subset`` or a
        ``ConcatDataset`` of it, say); every kept object when None."""
        with self._lock:
            for entry in list(self._entries.values()):
                root = entry.ref()
                if root is not None and (obj is None or reaches(root, obj)):
                    entry.version += 1

    def lost(self, slot: int) -> None:
        """The worker in ``slot`` may not hold what it was sent (its lease failed): the next
        loader sends it again, and the worker is still told when to drop it."""
        with self._lock:
            for entry in self._entries.values():
                held = entry.holders.get(slot)
                if held is not None:
                    entry.holders[slot] = (held[0], -1)
