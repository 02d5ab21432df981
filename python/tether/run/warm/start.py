"""``tether run``'s warm ranks: a node's zygote, and what each rank it forks does before the
interpreter runs the script.

The start-up hook (``_tether_warm``) calls ``serve`` in an interpreter started with the
ranks' own command line (``PYTHON -u SCRIPT ARGS`` or ``PYTHON -u -m MODULE ARGS``), right
before it would run the script; what tether itself imported by then is out of
``sys.modules`` already (a rank never sees it). ``serve`` checks the interpreter's start-up
hooks (``guard.startup_hooks``), then preloads the installed packages the script
imports (``scan``), each under record and undone afterwards (``guard``,
``run.warm.record``): a package whose import cannot be kept for the ranks is left to them, and
the zygote starts again without it. Then it serves tether-core's fork requests.

In each fork, ``serve`` makes the process the rank: the rank's environment, working
directory, umask, limits and standard streams (set by the fork request), the command line
and environment shown in ``/proc``, the stacks handler; a rank whose script or preloaded
files changed since the zygote started becomes a new interpreter instead (``_cold``). Then
it returns, and the interpreter runs the script exactly as ``python -u`` would, with a
``__main__`` of its own; the preload is hidden, and each package comes when the script's own
import reaches it (``serve``).

What cannot be the same as in a new interpreter: the hash seed (fixed when an interpreter
starts: the zygote's, shared by the ranks of a node)."""

from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import sys
import traceback
from typing import Any, Callable, Dict, List, NamedTuple, NoReturn, Optional, Set, Tuple

from tether import _native
from tether.common.log import logger
from tether.spawn import bootstrap
from tether.zygote import server

from . import guard, probes, scan
from .nodes import Node
from .record import signature
from .serve import Preloaded, Server, enter

#: The most times a zygote starts (each start leaves out at least one more module, never
#: one it left out before: a script of torch and torch.distributed takes three).
MAX_STARTS = 8
#: Seconds without a request before the zygote does its idle work.
QUIET = 1.0
#: The variables that only travel to the zygote.
_ROOM = "TETHER_WARM_ROOM"


class Zygote(NamedTuple):
    """What a zygote keeps for its ranks: its command line and name as it started, the
    script's imports as it read them, the preload, and the files a rank checks before it
    runs the script."""

    arguments: bytes
    comm: str
    parent: int
    event: str
    target: str
    plan: scan.Plan
    preloaded: Preloaded
    #: The files read by the imports that loaded compiled code, with their signatures, as
    #: ``_native.first_changed`` checks them (``packed_signatures``): they cannot be
    #: imported again in a rank, so a change means a new interpreter.
    files: Tuple[bytes, bytes]
    #: tether's own modules, out of ``sys.modules`` (the rendezvous helper takes them back).
    private: Dict[str, Any]


class DeclinedError(Exception):
    """Why this zygote cannot serve warm ranks (the launcher says it, in one line, and starts
    every rank as a new interpreter)."""


class Fds(NamedTuple):
    """The zygote's pipes to the launcher: its report, the fork requests and its notices."""

    report: int
    request: int
    notices: int


def serve(
    config: Dict[str, Any],
    event: str,
    target: str,
    set_audit: Callable[[Any], None],
    private: Dict[str, Any],
) -> None:
    """Runs the zygote for ``config`` (the launcher's), for the script or module ``target``
    (``event``: the audit event that started it); returns only in a rank."""
    environment = dict(os.environb)
    fds = _take_fds()
    with open("/proc/self/comm") as f:
        comm = f.read().strip()
    arguments = _native.command_line()
    varying = set(config["varying"])
    why = guard.startup_hooks(varying)
    if why is not None:
        raise DeclinedError(why)
    plan = scan.plan(event, target)
    modules, helper = _modules(config, plan)
    _name(modules)
    path = list(sys.path)
    directories = {p: signature(p) for p in path if p}
    found, owner = guard.preload(modules, _prefix(plan, config), varying, set_audit)
    if found.left_out or found.failed:
        _start_again(config, environment, found, list(fds))
    _single_threaded()
    environ = {k: v for k, v in os.environ.items() if k not in varying}
    preloaded = Preloaded(owner, sys.modules["__main__"], path, directories, environ, varying)
    parent = os.getppid()
    files = packed_signatures(_native_files(owner))
    zygote = Zygote(arguments, comm, parent, event, target, plan, preloaded, files, private)
    gc.freeze()  # the preload's objects, shared by every rank, are never walked there
    ready = {
        "helper": helper,
        "preloaded": found.preloaded,
        "left_out": config.get("left_out", []),
        "failed": config.get("failed", []),
    }
    # It keeps a child forked ahead for each rank (a restart costs no fork), and does that
    # (and its other idle work) once the ranks it has just started have had the CPU.
    blanks = int(config.get("blanks", 0))
    said = json.dumps(ready).encode()
    served = _native.zygote_serve(fds.request, fds.notices, parent, said, blanks, QUIET)
    if isinstance(served, int):
        os._exit(served)
    _become(served, zygote)


def _prefix(plan: scan.Plan, config: Dict[str, Any]) -> Set[str]:
    """The script's prefix imports that may load compiled code: those before the first one
    left to the ranks whose import changes what later imports read (a rank runs it)."""
    changers = {str(n) for n, why in config.get("left_out", []) if "changed" in str(why)}
    prefix: Set[str] = set()
    for name in plan.found:
        if name in changers:
            break
        if name in plan.prefix:
            prefix.add(name)
    return prefix


def _take_fds() -> Fds:
    """The zygote's pipes, out of the environment (its ranks never see them)."""
    report = int(os.environ.pop("TETHER_REPORT_FD"))
    request, notices = map(int, os.environ.pop(_native.ZYGOTE_FDS_ENV).split(","))
    os.environ.pop(_ROOM, None)
    for fd in (report, request, notices):
        os.set_inheritable(fd, False)
    return Fds(report, request, notices)


def _modules(config: Dict[str, Any], plan: scan.Plan) -> Tuple[List[str], bool]:
    """What to preload, in order, and whether the node's rendezvous helper is a fork of this
    zygote (for a script that imports torch anyway, whose rendezvous modules it preloads:
    the node imports torch once)."""
    skip = {str(name) for name, _ in config.get("left_out", []) + config.get("failed", [])}
    modules = _order(plan) + list(config["extra"])
    helper = any(m.split(".")[0] == "torch" for m in plan.found) and bool(config.get("helper"))
    if helper:
        modules += [m for m in config["helper"] if m.split(".")[0] != "tether"]
    return [m for m in dict.fromkeys(modules) if m not in skip], helper


def _order(plan: scan.Plan) -> List[str]:
    """The script's imports, those of its prefix first (each in the order met)."""
    return [m for m in plan.found if m in plan.prefix] + [
        m for m in plan.found if m not in plan.prefix
    ]


def _native_files(owner: Dict[str, Node]) -> Dict[str, Any]:
    files: Dict[str, Any] = {}
    nodes = {id(node): node for node in owner.values()}
    for node in nodes.values():
        if node.native:
            for each in node.tree():
                files.update(each.inputs.files)
    return files


def _single_threaded() -> None:
    """Makes sure the zygote forks from a single thread: a throwaway fork lets libraries
    stop the threads they stop at a fork (only when there is one: it costs tens of
    milliseconds with torch loaded); one that stays running fails the zygote."""
    if probes.threads():
        server._quiesce()
    running = probes.threads()
    if running:
        raise RuntimeError(f"the zygote has a thread running ({running[0]!r})")


def _name(modules: List[str]) -> None:
    summary = server.preload_summary(modules)
    title = f"tether zygote of pid {os.getppid()} (warm ranks; preload: {summary})"
    try:
        _native.set_title(title, _native.ZYGOTE_COMM)
    except OSError:
        pass


def _start_again(
    config: Dict[str, Any],
    environment: Dict[bytes, bytes],
    found: guard.Found,
    fds: List[int],
) -> NoReturn:
    """Replaces this zygote (same pid, same fds, the same command line) by a new one that
    leaves out the modules just found, whose imports cannot be kept for the ranks."""
    starts = int(config.get("starts", 1))
    if starts >= MAX_STARTS:
        raise RuntimeError(
            f"the zygote started {starts} times and still has modules to leave out: "
            + "; ".join(f"{name} ({why})" for name, why in found.left_out + found.failed)
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
        server._take_environment(env)
        bootstrap.reset_after_fork()
        if payload.get("kind") == "helper":
            _run_helper(payload, zygote)
        stacks = payload.get("stacks")
        stale = _stale(zygote)
        if stale is not None:
            _cold(zygote, stacks, shared_job, stale)
        _native.show_command_line(zygote.arguments, list(env.items()), zygote.comm)
        importlib.invalidate_caches()  # a file the user added since is found
        enter(Server(zygote.preloaded, _install_stacks(stacks)))
    except BaseException:  # noqa: BLE001 - this rank cannot run: its stderr says why
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _install_stacks(stacks: Optional[List[int]]) -> Dict[str, Any]:
    """Installs the stacks handler on the fork request's channel; the modules that took
    (``faulthandler``), kept out of ``sys.modules`` until the script imports them."""
    if not stacks:
        return {}
    before = set(sys.modules)
    bootstrap.install_stacks(_native.StacksChannel(int(stacks[0]), int(stacks[1])))
    return {name: sys.modules.pop(name) for name in set(sys.modules) - before}


def _stale(zygote: Zygote) -> Optional[str]:
    """Why this rank cannot have the preload (its script now imports otherwise, a file
    that compiled code's import read changed), or None."""
    if scan.plan(zygote.event, zygote.target) != zygote.plan:
        return "the script's imports changed since the zygote started"
    changed = _native.first_changed(*zygote.files)
    if changed is not None:
        path = os.fsdecode(zygote.files[0].split(b"\0")[changed])
        return f"{path} changed since the zygote started"
    return None


def packed_signatures(files: Dict[str, Optional[tuple]]) -> Tuple[bytes, bytes]:
    """``files`` (path -> ``signature``) as ``_native.first_changed`` reads them: the paths,
    each followed by a NUL byte, and their signatures packed in the same order."""
    paths = b"".join(os.fsencode(path) + b"\0" for path in files)
    packed = b"".join(_packed(known) for known in files.values())
    return paths, packed


def _packed(known: Optional[tuple]) -> bytes:
    """A signature as ``_native.first_changed`` reads it (``SIGNATURE_BYTES`` bytes):
    present, then modification time (ns, signed), size and inode, little-endian."""
    if known is None:
        return bytes(_native.SIGNATURE_BYTES)
    mtime_ns, size, inode = known
    return (
        b"\1"
        + mtime_ns.to_bytes(8, "little", signed=True)
        + size.to_bytes(8, "little")
        + inode.to_bytes(8, "little")
    )


def _cold(zygote: Zygote, stacks: Optional[List[int]], job: Optional[bytes], why: str) -> NoReturn:
    """Makes this process the rank as a new interpreter (``--no-warm``'s), before anything of
    the script ran: the same command line, this environment, the stacks channel."""
    logger.info("warm rank %s starts as a new interpreter: %s", os.environ.get("RANK"), why)
    env = dict(os.environb)
    if stacks:
        os.set_inheritable(int(stacks[0]), True)
        env[b"TETHER_STACKS_FD"] = f"{int(stacks[0])}:{int(stacks[1])}".encode()
    if job:
        env[_native.SHARE_JOB_ENV.encode()] = job
    argv = [arg for arg in zygote.arguments.split(b"\0") if arg]
    os.execve(sys.executable, argv, env)


def _run_helper(payload: Dict[str, Any], zygote: Zygote) -> NoReturn:
    """The node's rendezvous helper (``tether.run.rendezvous.helper``): it hears of the launcher's
    death by SIGTERM, as when it runs as ``python -m tether.run.rendezvous``. It is tether's
    own process: the preload and tether's modules are all in place."""
    _native.die_with_parent(signal.SIGTERM, zygote.parent)
    try:
        _native.set_title(f"tether rendezvous helper of pid {zygote.parent}", "tether-rdzv")
    except OSError:
        pass
    for node in {id(n): n for n in zygote.preloaded.owner.values()}.values():
        for name, module in node.modules.items():
            sys.modules.setdefault(name, module)
    sys.modules.update(zygote.private)
    from tether.run.rendezvous import helper as rendezvous

    rendezvous.main(["tether.run.rendezvous", payload["options"]])
    os._exit(0)
