"""``tether run``'s warm ranks: a node's zygote, and what each rank it forks does before the
interpreter runs the script.

The start-up hook (``_tether_warm``) calls ``serve`` in an interpreter started with the
ranks' own command line (``PYTHON -u SCRIPT ARGS`` or ``PYTHON -u -m MODULE ARGS``), right
before it would run the script. ``serve`` preloads the installed packages the script imports
(``_warm_scan``), under watch (``_warm_guard``: a module that reads what differs between
ranks or attempts, leaves a thread running, initializes CUDA or imports a module of the
user's is left to the ranks, and the zygote starts again without it), then serves
tether-core's fork requests. In each fork, ``serve`` makes the process the rank: the rank's
environment, working directory, umask, limits and standard streams (set by the fork
request), the command line and environment shown in ``/proc``, a fresh random state and
multiprocessing authkey, the stacks handler, what the preload printed; then it returns, and
the interpreter runs the script exactly as ``python -u`` would: ``__main__`` (its
``__file__``, ``-m``'s ``__spec__``), ``sys.argv``, ``sys.path[0]``, exit codes, tracebacks
and ``atexit`` handlers are the interpreter's own.

What cannot be the same as in a new interpreter: the hash seed (fixed when an interpreter
starts: the zygote's, shared by the ranks of a node), and the preloaded modules are in
``sys.modules`` before the script imports them."""

from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import sys
import traceback
from typing import Any, Dict, List, NamedTuple, NoReturn

from . import _child, _native, _warm_guard, _warm_scan, _zygote_server

#: How many times a zygote starts again without the modules it must leave to the ranks.
MAX_STARTS = 4
#: Seconds without a request before the zygote does its idle work.
QUIET = 1.0
#: The variables that only travel to the zygote.
_ROOM = "TETHER_WARM_ROOM"


class Zygote(NamedTuple):
    """What a zygote keeps for its ranks: its command line and name as it started, and what
    the preload printed."""

    arguments: bytes
    comm: str
    printed: _warm_guard.Captured
    parent: int


def serve(config: Dict[str, Any], event: str, target: str) -> None:
    """Runs the zygote for ``config`` (the launcher's), for the script or module ``target``
    (``event``: the audit event that started it); returns only in a rank."""
    environment = dict(os.environb)
    report_fd = int(os.environ.pop("TETHER_REPORT_FD"))
    request_fd, notices_fd = map(int, os.environ.pop(_native.ZYGOTE_FDS_ENV).split(","))
    os.environ.pop(_ROOM, None)
    for fd in (report_fd, request_fd, notices_fd):
        os.set_inheritable(fd, False)
    with open("/proc/self/comm") as f:
        comm = f.read().strip()
    arguments = _native.command_line()
    left_out = [(str(name), str(why)) for name, why in config.get("left_out", [])]
    skip = {name for name, _ in left_out + [tuple(p) for p in config.get("failed", [])]}
    modules = _warm_scan.preload(event, target, config["extra"])
    # What the node's rendezvous helper needs, for a script that imports torch anyway (the
    # helper is then a fork of this zygote, and the node imports torch once).
    helper = any(m.split(".")[0] == "torch" for m in modules) and bool(config.get("helper"))
    if helper:
        modules += config["helper"]
    modules = [m for m in dict.fromkeys(modules) if m not in skip]
    _name(modules)
    with _warm_guard.captured() as printed:
        found = _warm_guard.preload(modules, set(config["varying"]))
    if found.left_out or found.failed:
        _start_again(config, environment, found, [report_fd, request_fd, notices_fd])
    _single_threaded()
    gc.freeze()  # the preload's objects, shared by every rank, are never walked there
    ready = {
        "helper": helper,
        "preloaded": found.preloaded,
        "left_out": left_out,
        "failed": config.get("failed", []),
    }
    zygote = Zygote(arguments, comm, printed, os.getppid())
    # It keeps a child forked ahead for each rank (a restart costs no fork), and does that
    # (and its other idle work) once the ranks it has just started have had the CPU.
    blanks = int(config.get("blanks", 0))
    served = _native.zygote_serve(
        request_fd, notices_fd, zygote.parent, json.dumps(ready).encode(), blanks, QUIET
    )
    if isinstance(served, int):
        os._exit(served)
    _become(served, zygote)


def _single_threaded() -> None:
    """Makes sure the zygote forks from a single thread: a throwaway fork lets libraries
    stop the threads they stop at a fork (only when there is one: it costs tens of
    milliseconds with torch loaded); one that stays running fails the zygote."""
    if _warm_guard.threads():
        _zygote_server._quiesce()
    running = _warm_guard.threads()
    if running:
        raise RuntimeError(f"the zygote has a thread running ({running[0]!r})")


def _name(modules: List[str]) -> None:
    summary = _zygote_server.preload_summary(modules)
    title = f"tether zygote of pid {os.getppid()} (warm ranks; preload: {summary})"
    try:
        _native.set_title(title, "tether-zygote")
    except OSError:
        pass


def _start_again(
    config: Dict[str, Any],
    environment: Dict[bytes, bytes],
    found: _warm_guard.Found,
    fds: List[int],
) -> NoReturn:
    """Replaces this zygote (same pid, same fds, the same command line) by a new one that
    leaves out the modules just found, whose imports cannot be undone here."""
    starts = int(config.get("starts", 1))
    if starts >= MAX_STARTS:
        raise RuntimeError(
            f"the zygote started {starts} times and still has modules to leave out: "
            + ", ".join(name for name, _ in found.left_out + found.failed)
        )
    config = dict(
        config,
        starts=starts + 1,
        left_out=config.get("left_out", []) + [list(p) for p in found.left_out],
        failed=config.get("failed", []) + [list(p) for p in found.failed],
        extra=list(dict.fromkeys(config["extra"] + found.beneath)),
    )
    environment[b"TETHER_WARM"] = json.dumps(config).encode()
    for fd in fds:
        os.set_inheritable(fd, True)
    argv = [bytes.fromhex(arg) for arg in config["argv"]]
    os.execvpe(argv[0], argv, environment)


def _become(job: _native.Job, zygote: Zygote) -> None:
    """In a fork: makes this process the rank (or the rendezvous helper) the fork request
    asked for; returns in a rank, for the interpreter to run the script."""
    try:
        os.close(job.take_report_fd())
        payload = json.loads(bytes(job.take_payload()))
        if job.error is not None:
            raise job.error
        env = dict(job.env)
        shared_job = env.pop(_native.SHARE_JOB_ENV.encode(), None)
        if shared_job:
            _native.share_enter_job(shared_job.decode())
        _zygote_server._take_environment(env)
        _child.reset_after_fork()
        _fresh_state()
        if payload.get("kind") == "helper":
            _run_helper(payload, zygote)
        _native.show_command_line(zygote.arguments, list(env.items()), zygote.comm)
        stacks = payload.get("stacks")
        if stacks:
            _child.install_stacks(_native.StacksChannel(int(stacks[0]), int(stacks[1])))
        _warm_guard.replay(zygote.printed)
    except BaseException:  # noqa: BLE001 - this rank cannot run: its stderr says why
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _fresh_state() -> None:
    """What a new interpreter has of its own: random state (Python's ``random`` reseeds
    itself after a fork), multiprocessing's authkey and original directory, and the import
    system's caches of directory listings (a file the user added since is found)."""
    _zygote_server._reseed()
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        process.current_process().authkey = os.urandom(32)
        try:
            process.ORIGINAL_DIR = os.path.abspath(os.getcwd())  # type: ignore[attr-defined]
        except OSError:
            process.ORIGINAL_DIR = None  # type: ignore[attr-defined]
    importlib.invalidate_caches()


def _run_helper(payload: Dict[str, Any], zygote: Zygote) -> NoReturn:
    """The node's rendezvous helper (``tether._rendezvous``): it hears of the launcher's
    death by SIGTERM, as when it runs as ``python -m tether._rendezvous``."""
    _native.die_with_parent(signal.SIGTERM, zygote.parent)
    try:
        _native.set_title(
            f"tether rendezvous helper of pid {zygote.parent}", "tether-rdzv"
        )
    except OSError:
        pass
    from . import _rendezvous

    _rendezvous.main(["tether._rendezvous", payload["options"]])
    os._exit(0)
