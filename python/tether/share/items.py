"""The shared objects of ``tether.share``: one copy of a dataset per machine, read by every
process that uses it.

``shared(obj)`` turns a list or tuple into a read-only ``SharedList`` (a
``collections.abc.Sequence``) and a dict into a read-only ``SharedDict`` (a
``collections.abc.Mapping``, in the dict's order). Each item is pickled on its own into one
sealed memfd (no ``/dev/shm``, whatever its size limit), with an offset index; a dict's keys
also go into a hash table of their canonical bytes (``_native``'s ``keys``: ``1``, ``1.0``
and ``True`` are one key, as in a dict), never of ``hash()``, so that a lookup does not
depend on a process's hash seed. Reading an item unpickles it from the shared pages, which
are mapped read-only: nothing writes to them, so they stay shared however often every
process reads them (a Python list's pages do not: reading an object writes its reference
count, and a forked reader's copy of every page it reads becomes its own).

A ``SharedList`` or ``SharedDict`` travels as a reference: pickled by tether's pickler or by
multiprocessing's ``ForkingPickler`` (a process start, a queue), it is the memfd that
travels (``DupFd``), and the receiver maps the same pages. Plain ``pickle`` (and
``torch.save``) writes the items, which load as a new shared copy, equal to this one.

``tether.share`` (``share.meeting``) makes them, also once for the ranks of a job on a machine."""

from __future__ import annotations

import os
import sys
from collections.abc import ItemsView, Mapping, Sequence, ValuesView
from multiprocessing.reduction import DupFd
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Tuple,
    Union,
    cast,
    overload,
)

from tether import _native
from tether.common import pickling

__all__ = ["SharedDict", "SharedList", "shared"]

#: How many items ``repr`` shows.
_REPR_ITEMS = 3


def _refuse(kind: str, copy: str, again: str) -> Callable[..., Any]:
    """A mutating method of a shared object: a TypeError that says how to change it."""

    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"tether.{kind} is read-only: its items live in shared memory that every process "
            f"reading it maps. To change it, make a copy ({copy}), change the copy and share "
            f"it again ({again})"
        )

    return refuse


def _same(a: Any, b: Any) -> bool:
    """``a == b`` as a list compares its items: identity first."""
    return a is b or bool(a == b)


class SharedList(_native.SharedItems, Sequence):
    """A read-only list whose items live in shared memory (see ``tether.share``): length,
    int and slice indexing (negative indexes too; a slice is a list), iteration, ``in``,
    ``index``, ``count``, and equality with a list or tuple of the same items (it is
    unhashable, as a list). ``SharedList(items)``
    shares the items of any iterable. Indexing, length, iteration and ``in`` are the
    compiled base's (``_native.SharedItems``)."""

    __slots__ = ()

    def __new__(cls, items: Iterable[Any] = ()) -> "SharedList":
        if type(items) is cls:
            return items
        values = items if isinstance(items, (list, tuple)) else list(items)
        return super().__new__(
            cls, _native.SharedTable.of_list(values, _memfd_name("a list", values))
        )

    if TYPE_CHECKING:

        @overload
        def __getitem__(self, index: int) -> Any: ...

        @overload
        def __getitem__(self, index: slice) -> List[Any]: ...

        def __getitem__(self, index: Union[int, slice]) -> Any: ...

    def index(self, value: Any, start: int = 0, stop: int = sys.maxsize) -> int:
        """The first index of ``value`` in ``[start:stop]``, as ``list.index``."""
        n = len(self)
        start = max(start + n, 0) if start < 0 else min(start, n)
        stop = max(stop + n, 0) if stop < 0 else min(stop, n)
        for i, item in enumerate(self._iterate(0, start), start):
            if i >= stop:
                break
            if _same(item, value):
                return i
        raise ValueError(f"{value!r} is not in SharedList")

    def count(self, value: Any) -> int:
        return sum(1 for item in self if _same(item, value))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SharedList):
            if self._same(other):
                return True
        elif not isinstance(other, (list, tuple)):
            return NotImplemented
        return len(self) == len(other) and all(map(_same, self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        n = len(self)
        shown = [repr(item) for item in self[:_REPR_ITEMS]]
        if n > _REPR_ITEMS:
            shown.append(f"... {n - _REPR_ITEMS:,} more")
        return f"tether.SharedList([{', '.join(shown)}])"

    def __reduce__(self) -> Tuple[Any, Tuple[List[Any]]]:
        # Plain pickle (torch.save): the items themselves; see ``_reduce`` for the others.
        return SharedList, (list(self),)

    def __copy__(self) -> "SharedList":
        return self

    def __deepcopy__(self, memo: Any) -> "SharedList":
        return self

    _refused = _refuse("SharedList", "items = list(shared)", "tether.share(items)")
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refused
    append = extend = insert = pop = remove = clear = sort = reverse = _refused


class _Values(ValuesView):
    """A shared dict's values, read in one pass."""

    def __init__(self, shared: "SharedDict") -> None:
        super().__init__(shared)
        self._shared = shared

    def __iter__(self) -> Iterator[Any]:
        return self._shared._iterate(2)


class _Items(ItemsView):
    """A shared dict's pairs, read in one pass."""

    def __init__(self, shared: "SharedDict") -> None:
        super().__init__(shared)
        self._shared = shared

    def __iter__(self) -> Iterator[Tuple[Any, Any]]:
        return self._shared._iterate(0)


_MISSING = object()


class SharedDict(_native.SharedItems, Mapping):
    """A read-only dict whose keys and values live in shared memory (see
    ``tether.share``), in the dict's order; keys of any picklable hashable type, looked up
    by their canonical bytes, whatever the process's hash seed, and found as a dict finds
    them (``np.int64(3)`` and ``3.0`` find ``3``). ``reversed()`` and ``|`` as a dict's
    (``|`` gives a new dict); ``|=``, as every mutation, raises. ``SharedDict(mapping)``
    shares what ``dict(mapping)`` holds. Lookups, length, iteration and ``in`` are the
    compiled base's (``_native.SharedItems``)."""

    __slots__ = ()

    def __new__(cls, items: Any = (), **kwargs: Any) -> "SharedDict":
        if type(items) is cls and not kwargs:
            return items
        values = dict(items, **kwargs)
        return super().__new__(
            cls, _native.SharedTable.of_dict(values, _memfd_name("a dict", values))
        )

    def get(self, key: Any, default: Any = None) -> Any:
        return self._get(key, default)

    def values(self) -> ValuesView:
        return _Values(self)

    def items(self) -> ItemsView:
        return _Items(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SharedDict) and self._same(other):
            return True
        if not isinstance(other, Mapping):
            return NotImplemented
        if len(self) != len(other):
            return False
        return all(_same(other.get(k, _MISSING), v) for k, v in self._iterate(0))

    __hash__ = None  # type: ignore[assignment]

    def __reversed__(self) -> Iterator[Any]:
        """The keys, the last inserted first, as ``reversed(dict)``."""
        for i in range(len(self) - 1, -1, -1):
            yield next(self._iterate(1, i))

    def __or__(self, other: Any) -> Any:
        """A new dict: this one's pairs, then ``other``'s (as ``MappingProxyType``)."""
        if not isinstance(other, Mapping):
            return NotImplemented
        merged = dict(self._iterate(0))
        merged.update(other)
        return merged

    def __ror__(self, other: Any) -> Any:
        if not isinstance(other, Mapping):
            return NotImplemented
        merged = dict(other)
        merged.update(self._iterate(0))
        return merged

    def __repr__(self) -> str:
        pairs = self._iterate(0)
        shown = [f"{k!r}: {v!r}" for _, (k, v) in zip(range(_REPR_ITEMS), pairs)]
        if len(self) > _REPR_ITEMS:
            shown.append(f"... {len(self) - _REPR_ITEMS:,} more")
        return f"tether.SharedDict({{{', '.join(shown)}}})"

    def __reduce__(self) -> Tuple[Any, Tuple[Dict[Any, Any]]]:
        return SharedDict, (dict(self._iterate(0)),)

    def __copy__(self) -> "SharedDict":
        return self

    def __deepcopy__(self, memo: Any) -> "SharedDict":
        return self

    _refused = _refuse("SharedDict", "d = dict(shared)", "tether.share(d)")
    __setitem__ = __delitem__ = __ior__ = _refused
    pop = popitem = clear = update = setdefault = _refused


#: The shared objects' classes.
SHARED = (SharedList, SharedDict)


def _memfd_name(kind: str, values: Any) -> str:
    """What the memfd is called in ``/proc/PID/maps`` (``/memfd:tether.share ...``)."""
    return f"tether.share: {kind} of {len(values)} items"


def from_fd(fd: int) -> Union[SharedList, SharedDict]:
    """The shared object in the memfd ``fd`` (handed over), made in any process."""
    try:
        kind = SharedDict if _native.share_is_dict(fd) else SharedList
    except BaseException:
        os.close(fd)
        raise
    table = _native.SharedTable.of_fd(fd)
    return cast("Union[SharedList, SharedDict]", _native.SharedItems.__new__(kind, table))


def _rebuild(is_dict: bool, fd: Any) -> Union[SharedList, SharedDict]:
    """A shared object in the process that unpickles it: the same memfd, mapped here."""
    return from_fd(fd.detach())


def _reduce(obj: Union[SharedList, SharedDict]) -> Tuple[Any, Tuple[bool, Any]]:
    """How ``ForkingPickler`` and tether's pickler send a shared object: its memfd (through
    the process start's fds, a tether message's, or multiprocessing's resource sharer)."""
    return _rebuild, (isinstance(obj, SharedDict), DupFd(obj._fileno()))


pickling.register(SharedList, _reduce)
pickling.register(SharedDict, _reduce)


def shared(obj: Any, what: str) -> Union[SharedList, SharedDict]:
    """``obj`` shared: a list or tuple as a ``SharedList``, a dict as a ``SharedDict``, a
    shared object as itself; anything else is a TypeError: ``what`` (what the caller takes),
    not that."""
    if isinstance(obj, (SharedList, SharedDict)):
        return obj
    if isinstance(obj, (list, tuple)):
        return SharedList(obj)
    if isinstance(obj, dict):
        return SharedDict(obj)
    raise TypeError(f"{what}, not {type(obj).__qualname__}")
