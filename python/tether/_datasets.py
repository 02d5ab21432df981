"""How a DataLoader's dataset, ``collate_fn`` and ``worker_init_fn`` reach the pool's
workers: once, and then never again while the parent holds them.

torch's worker loop receives these objects with every ``iter(loader)``. On a pool the
workers outlive the iterator, so they keep what they received (``_kept``, keyed by the
parent's object), and a later loader over the same objects sends a reference of a few
bytes instead of the objects. ``Kept`` is the parent's record of it, one per pool:

- each object has a key that is never reused (a new object that takes a freed one's address
  is a new object), a version, and which worker holds which version;
- a version ends when the object changes in a way the pool notices (an attribute rebound,
  at any depth of the objects it holds as attributes or in tuples; a torch tensor among
  them changed in place: its ``_version``), or on ``refresh``; the next loader then sends
  the object again. A change inside a list, dict or set it holds is not noticed;
- when the parent drops an object, each worker that holds it is told to drop its copy with
  its next lease.

When an object must cross (its first loader, a new version, or a context made with
``keep_datasets=False``, which keeps nothing), it travels in the loader's one
``_shipment.Shipment``, pickled once per loader, not once per worker."""

from __future__ import annotations

import collections
import itertools
import sys
import threading
import types
import weakref
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from . import _shipment

__all__ = ["Kept"]

#: The arguments of torch's worker loop that carry objects a worker keeps.
KEPT_ARGUMENTS = ("dataset_holder", "dataset", "collate_fn", "init_fn")


def _carries(name: str, value: Any) -> bool:
    """Whether an argument of torch's worker loop carries an object to keep
    (``dataset_holder`` is a list of one, which the worker loop empties)."""
    if name == "dataset_holder":
        return isinstance(value, list) and len(value) == 1
    return value is not None


#: How much of an object's attribute graph a change check walks (it runs once per loader).
WALK_DEPTH = 4
WALK_NODES = 512
#: Tuples longer than this, and objects with more attributes, are not walked.
WALK_ITEMS = 64
_OPAQUE = (type, types.ModuleType, types.BuiltinFunctionType, types.FunctionType, types.MethodType)


_SCALARS = (bool, int, float, complex)


def _token(value: Any) -> Any:
    """What stands for a value in a snapshot, without keeping it alive (a value kept could
    keep the dataset itself alive, through a bound method, say): a small scalar itself, a
    weak reference, or else the value's address."""
    if (
        value is None
        or isinstance(value, _SCALARS)
        or (isinstance(value, str) and len(value) < 256)
    ):
        return value
    try:
        return weakref.ref(value)
    except TypeError:
        return _Address(id(value))


class _Address(int):
    """The address of a value that takes no weak reference (a list, a dict)."""


def _same_token(a: Any, b: Any) -> bool:
    if isinstance(a, weakref.ref):
        return isinstance(b, weakref.ref) and a() is not None and a() is b()
    return type(a) is type(b) and a == b


Snapshot = List[Tuple[Any, Any, int]]


def _snapshot(obj: Any) -> Snapshot:
    """What the change check compares: ``(path, token, tensor version)`` for the values in
    ``obj``'s attribute graph (the attributes of objects, the items of short tuples; the
    items of lists, dicts and sets are their container's business), down to
    ``WALK_DEPTH``."""
    torch = sys.modules.get("torch")
    tensor = None if torch is None else getattr(torch, "Tensor", None)
    out: Snapshot = []
    seen = set()
    todo: List[Tuple[Any, Any, int]] = [((), obj, 0)]
    while todo and len(out) < WALK_NODES:
        path, value, depth = todo.pop()
        version = -1
        if tensor is not None and isinstance(value, tensor):
            version = value._version
        out.append((path, None if depth == 0 else _token(value), version))
        if depth >= WALK_DEPTH or id(value) in seen or version >= 0:
            continue
        seen.add(id(value))
        if isinstance(value, tuple):
            if len(value) <= WALK_ITEMS:
                todo.extend(((path, i), item, depth + 1) for i, item in enumerate(value))
        elif not isinstance(value, (list, dict, set, _OPAQUE)):
            state = getattr(value, "__dict__", None)
            if isinstance(state, dict) and len(state) <= WALK_ITEMS:
                todo.extend(((path, name), item, depth + 1) for name, item in state.items())
    return out


def _same(a: Snapshot, b: Snapshot) -> bool:
    return len(a) == len(b) and all(
        x[2] == y[2] and x[0] == y[0] and _same_token(x[1], y[1]) for x, y in zip(a, b)
    )


class _Entry:
    """An object the workers may hold."""

    __slots__ = ("key", "address", "ref", "version", "snapshot", "holders")

    def __init__(self, key: int, obj: Any) -> None:
        self.key = key
        self.address = id(obj)
        self.ref = weakref.ref(obj)
        self.version = 0
        self.snapshot = _snapshot(obj)
        #: slot -> (pid, version) of the worker there that holds the object.
        self.holders: Dict[int, Tuple[int, int]] = {}


class _Element:
    """One of a loader's kept objects as this loader found it: the object, its entry (None
    when it cannot be watched, or nothing is kept), the entry's version, and for a bound
    method the method's name (the entry is then its object's)."""

    __slots__ = ("obj", "entry", "version", "method")

    def __init__(self, obj: Any, entry: Optional[_Entry], method: Optional[str]) -> None:
        self.obj = obj
        self.entry = entry
        self.version = -1 if entry is None else entry.version
        self.method = method

    def held_by(self, slot: int, pid: int) -> bool:
        return self.entry is not None and self.entry.holders.get(slot) == (pid, self.version)


class _Iteration:
    """What one DataLoader iterator's leases share: its kept objects, seen once, and their
    shipment, made once."""

    __slots__ = ("elements", "shipment", "__weakref__")

    def __init__(self) -> None:
        self.elements: Optional[List[_Element]] = None
        self.shipment: Optional[_shipment.Shipment] = None

    def close(self) -> None:
        if self.shipment is not None:
            self.shipment.close()
        self.shipment = None
        self.elements = None


class Kept:
    """A pool's record of the objects its workers hold (see the module's documentation)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys = itertools.count(1)
        self._entries: Dict[int, _Entry] = {}
        #: Entries whose object is gone; appended by finalizers (which never take the lock).
        self._dropped: Deque[_Entry] = collections.deque()
        #: slot -> keys its worker drops with its next lease.
        self._forget: Dict[int, List[int]] = {}
        self._iterations: "weakref.WeakKeyDictionary[Any, _Iteration]" = weakref.WeakKeyDictionary()

    def prepare(
        self, call: Dict[str, Any], slot: int, pid: int, keep: bool
    ) -> Tuple[Dict[str, Any], _shipment.Forgetting, Callable[[], None]]:
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
                refs: List[Any] = [
                    _shipment.Held(e.entry.key, e.method) for e in elements if e.entry
                ]
            else:
                if iteration.shipment is None:
                    keys = [(None if e.entry is None else e.entry.key, e.method) for e in elements]
                    iteration.shipment = _shipment.Shipment(tuple(objs), keys)
                refs = [iteration.shipment.part(i) for i in range(len(objs))]
                sent = [e for e in elements if e.entry is not None]
            out = dict(call)
            for name, ref in zip(names, refs):
                out[name] = [ref] if name == "dataset_holder" else ref
            forget = _shipment.Forgetting(self._forget.get(slot, ()))
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
            snapshot = _snapshot(obj)
            if not _same(entry.snapshot, snapshot):
                entry.version += 1
                entry.snapshot = snapshot
            return entry
        try:
            entry = _Entry(next(self._keys), obj)
            weakref.finalize(obj, self._dropped.append, entry)
        except TypeError:
            return None
        self._entries[entry.address] = entry
        return entry

    def _collect_dropped(self) -> None:
        while self._dropped:
            entry = self._dropped.popleft()
            if self._entries.get(entry.address) is entry:
                del self._entries[entry.address]
            entry.snapshot = []
            for slot in entry.holders:
                self._forget.setdefault(slot, []).append(entry.key)

    def refresh(self, obj: Any = None) -> None:
        """The next loader sends ``obj`` again (every object, when None)."""
        with self._lock:
            entries = (
                list(self._entries.values())
                if obj is None
                else [e for e in [self._entries.get(id(obj))] if e is not None and e.ref() is obj]
            )
            for entry in entries:
                entry.version += 1

    def lost(self, slot: int) -> None:
        """The worker in ``slot`` may not hold what it was sent (its lease failed): the next
        loader sends it again, and the worker is still told when to drop it."""
        with self._lock:
            for entry in self._entries.values():
                held = entry.holders.get(slot)
                if held is not None:
                    entry.holders[slot] = (held[0], -1)
