"""``tether.share``: one copy of a dataset per machine, read by every process that uses it
(the objects are ``items``'s), and its key form, ``tether.share(build, key="name")``: one
copy for the ranks of a job on a machine, built by one of them.

The ranks meet at a meeting point named after the job and the key (tether-core's
``share::meet``: an abstract Unix socket, no file). The job has an id: ``tether run`` gives
its ranks one in ``TETHER_JOB_ID`` (one per launcher, that is per job and machine; a
rank's start-up takes it out of the environment, which stays torchrun's), and
``tether.spawn`` one to the children of each call (with their payload, see
``bootstrap.enter_job``): ranks of other jobs never meet these. The
first rank to ask builds (``build()``) and publishes the memfd; the others wait and map it
without calling ``build()``. Every process that holds the copy answers later askers, and so
does the job's vault (``share::vault``), which ``tether run``'s supervisor and
``tether.spawn``'s caller keep for the job and the builder hands the copy to: a rank that
asks after every other rank has exited still maps it. Once the job has ended and every
holder has exited, the name and the memfd are gone: nothing is left behind.

- ``build()`` raising: every waiting rank (and every later one, while the builder lives)
  raises the same exception, its type and text, with the builder's traceback as its cause;
  the builder raises it too.
- a builder that dies before it is done: its waiters see it hang up, and the first of them
  to claim the name builds instead, with a warning that names the dead builder (rank, pid,
  how it ended). Nothing waits for ever.

Without a job id (a plain ``python`` process), there is no job to meet: ``build()`` runs in
this process. In any case a process builds a key once and keeps the copy (the same object
on every call) until it exits."""

from __future__ import annotations

import os
import pickle
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, Optional, Tuple, Union

from tether import _native
from tether.common import reports, words

from . import items

__all__ = ["share"]

Shared = Union[items.SharedList, items.SharedDict]

_lock = threading.Lock()
#: One lock a (job, key), so that two threads of a process build a key once.
_key_locks: Dict[Tuple[str, str], threading.Lock] = {}
#: (job, key) -> the copy this process holds, and its meeting point (None without a job).
_held: Dict[Tuple[str, str], Tuple[Shared, Optional[_native.ShareMeeting]]] = {}
#: (job, key) -> the meeting point of a build of this process that failed (it answers with
#: the error until this process builds the key again).
_failed: Dict[Tuple[str, str], _native.ShareMeeting] = {}


#: The vaults of the jobs this process started (``tether.spawn``), alive while their jobs run.
_vaults: "weakref.WeakSet[_native.ShareVault]" = weakref.WeakSet()


def vault(job: str) -> _native.ShareVault:
    """The vault of the job ``job`` that this process starts: it holds the copies its ranks
    build with the key form until the job ends (it is dropped), so that a rank that asks
    after the others have exited still maps the copy."""
    started = _native.ShareVault(job)
    _vaults.add(started)
    return started


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, say) keeps the copies, maps and all, but does
    not answer at the meeting points (their names must go when the holders go), and holds
    nothing of the vaults (their memory must go when their jobs end)."""
    global _lock
    _lock = threading.Lock()
    _key_locks.clear()
    for kept in list(_vaults):
        kept.close_after_fork()
    for _, meeting in _held.values():
        if meeting is not None:
            meeting.close_after_fork()
    for meeting in _failed.values():
        meeting.close_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def share(obj: Any, key: Optional[str] = None) -> Shared:
    """One read-only copy of ``obj`` in shared memory: a list or tuple becomes a
    ``SharedList``, a dict a ``SharedDict``. Every process it reaches (DataLoader workers of
    every start method, ``tether.Pool`` workers, ``tether.spawn`` ranks, executor tasks)
    maps the same pages, and reading never copies them: ``self.samples =
    tether.share(self.samples)`` keeps one copy of an ImageFolder's samples for all its
    workers.

    ``share(build, key="name")``: the ranks of one job on this machine (under ``tether
    run``, or of one ``tether.spawn``) that ask for the same key map one copy: the first
    calls ``build()`` (no argument; it returns a list, tuple or dict), the others wait and
    map what it built. An error of ``build()`` is raised in every rank that waited."""
    if key is not None:
        return _share_key(obj, key)
    if callable(obj) and not isinstance(obj, (list, tuple, dict, *_SHARED)):
        raise TypeError(
            "tether.share(build) needs a key: tether.share(build, key='name') builds one "
            "copy for the ranks of this machine; tether.share(obj) shares a list, a tuple "
            "or a dict"
        )
    return items.shared(obj, "tether.share takes a list, a tuple or a dict")


_SHARED = (items.SharedList, items.SharedDict)


def _share_key(build: Callable[[], Any], key: str) -> Shared:
    """``tether.share(build, key=key)`` (see the module's documentation)."""
    if not isinstance(key, str):
        raise TypeError(f"tether.share's key must be a str, not {type(key).__qualname__}")
    if not callable(build):
        raise TypeError(
            "tether.share(build, key=...) takes a function that builds the list or dict "
            f"(it is called in one rank only), not {type(build).__qualname__}"
        )
    job = _job()
    with _lock:
        lock = _key_locks.setdefault((job, key), threading.Lock())
    with lock:
        held = _held.get((job, key))
        if held is not None:
            return held[0]
        if job:
            shared, meeting = _meet(job, key, build)
        else:
            shared, meeting = _built(build, key), None
        _held[(job, key)] = (shared, meeting)
        return shared


def _built(build: Callable[[], Any], key: str) -> Shared:
    what = f"tether.share(key={key!r}): build() must return a list, a tuple or a dict"
    return items.shared(build(), what)


def _job() -> str:
    """This process's job: a ``tether.spawn`` child's, else a ``tether run`` rank's (its
    ``TETHER_JOB_ID``, which the rank's start-up takes out of its environment), else none
    ("")."""
    from tether.spawn import bootstrap

    return bootstrap.job_id or _native.share_job() or os.environ.get(_native.SHARE_JOB_ENV, "")


def _rank() -> int:
    """This process's rank: a ``tether.spawn`` child's, else ``RANK`` (``tether run``,
    torchrun), else -1."""
    from tether.spawn import bootstrap

    if bootstrap.job_rank is not None:
        return bootstrap.job_rank
    try:
        return int(os.environ.get("RANK", ""))
    except ValueError:
        return -1


def _meet(job: str, key: str, build: Callable[[], Any]) -> Tuple[Shared, _native.ShareMeeting]:
    """Builds the key here, or maps what its builder built."""
    failed = _failed.pop((job, key), None)
    if failed is not None:  # this process holds the name, with its last build's error
        failed.rebuild()
        return _build_here(failed, build, job, key), failed
    (name, _), rank = _native.share_names(job, key), _rank()
    died: Optional[Tuple[int, int, Optional[int]]] = None
    while True:
        claimed = _native.share_claim(name, rank)
        if isinstance(claimed, _native.ShareMeeting):
            if died is not None:
                me = words.who(rank, os.getpid())
                warnings.warn(
                    words.share_builder_died(key, *died, me), RuntimeWarning, stacklevel=4
                )
            return _build_here(claimed, build, job, key), claimed
        outcome = claimed.wait()
        if isinstance(outcome, _native.ShareReady):
            return _hold(name, outcome.memfd, outcome.listener, rank)
        if isinstance(outcome, _native.ShareFailed):
            raise _builder_error(outcome.report, key, outcome.rank, outcome.pid)
        if isinstance(outcome, _native.ShareBuilderDied):
            died = (outcome.rank, outcome.pid, outcome.exitcode)
        # ShareLost: the holder that accepted hung up first; ask again.


def _build_here(
    meeting: _native.ShareMeeting, build: Callable[[], Any], job: str, key: str
) -> Shared:
    try:
        shared = _built(build, key)
    except BaseException as exc:
        meeting.fail(_describe(exc))
        _failed[(job, key)] = meeting
        raise
    meeting.publish(shared._fileno())
    try:
        meeting.hand_over(_native.share_names(job, key)[1])  # the job's vault keeps it
    except OSError:
        pass  # out of fds, say: the ranks that hold the copy still answer
    return shared


def _hold(name: bytes, memfd: int, listener: int, rank: int) -> Tuple[Shared, _native.ShareMeeting]:
    """Maps the copy a holder sent, and answers later askers from here too."""
    try:
        shared = items.from_fd(memfd)
    except BaseException:
        os.close(listener)
        raise
    meeting = _native.ShareMeeting.hold(name, listener, os.dup(shared._fileno()), rank)
    return shared, meeting


def _describe(exc: BaseException) -> bytes:
    """What waiting ranks get of a build's error (see ``reports.describe``)."""
    return pickle.dumps(tuple(reports.describe(exc)))


def _builder_error(report: bytes, key: str, rank: int, pid: int) -> BaseException:
    """The builder's exception, rebuilt here (see ``reports.rebuild``)."""
    where = f"build() of tether.share(key={key!r}) in {words.who(rank, pid)} raised:\n"
    return reports.rebuild(reports.Described(*pickle.loads(report)), where)
