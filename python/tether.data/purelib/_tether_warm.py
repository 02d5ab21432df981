"""The start-up hook of ``tether run``'s warm ranks, loaded by ``tether_warm.pth`` only when
``TETHER_WARM`` is set (in every other process the ``.pth`` line costs one lookup in
``os.environ``).

``tether run`` starts each node's zygote as ``PYTHON -c BOOTSTRAP`` with ``TETHER_WARM`` (the
launcher's configuration, JSON) in its environment. The audit hook installed here acts once,
on the event that comes right before an interpreter runs its main program:

- in that first interpreter (``cpython.run_command``), it replaces the process (``execvpe``)
  by the ranks' own command line, ``PYTHON -u SCRIPT ARGS`` or ``PYTHON -u -m MODULE ARGS``,
  so that the zygote's command line, ``sys.argv``, ``sys.path[0]``, flags and standard
  streams are those of a rank started cold;
- in that interpreter (``cpython.run_file``, ``cpython.run_module``), it makes the process
  the zygote (``tether.run.warm.start``), which returns only in the ranks it forks: each rank then
  goes on from this very point, and the interpreter runs the script as it would have.

Without this hook (tether is not installed for that interpreter) the bootstrap's own code
runs instead, which exits with status 75 and runs nothing of the user's. A zygote that
fails never falls through to the script: it writes a report for the launcher (the frame of
``tether_core::report``) on ``TETHER_REPORT_FD`` and exits."""

import sys

#: The modules loaded before this hook: what it imports itself is tether's, which a rank
#: never sees (see ``install``).
_BEFORE = set(sys.modules)

import atexit  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import struct  # noqa: E402
import traceback  # noqa: E402

_VARIABLE = "TETHER_WARM"
#: The version of the launcher's configuration this hook reads.
_VERSION = 1

_config = {}
_done = False
#: Where the zygote's recorder wants the interpreter's audit events while it preloads.
_watcher = None
#: The zygote's report pipe (its number stays in the environment until the zygote runs).
_report_fd = -1


def install() -> None:
    """Takes the configuration out of the environment (the zygote's own children never see
    it) and installs the hook."""
    global _config, _report_fd
    try:
        _config = json.loads(os.environ.pop(_VARIABLE, ""))
        _report_fd = int(os.environ.get("TETHER_REPORT_FD", "-1"))
    except ValueError:
        return  # the bootstrap runs and says that no hook took over
    sys.addaudithook(_hook)
    if _config.get("phase") == "zygote":
        # What this hook imported is tether's: the start-up code that follows (other .pth
        # files, sitecustomize), and the script's ranks, import their own.
        for name in set(sys.modules) - _BEFORE | {__name__}:
            sys.modules.pop(name, None)


def _set_watcher(watcher) -> None:
    """Sends the audit events to ``watcher`` (None: no more)."""
    global _watcher
    _watcher = watcher


def _hook(event: str, args: tuple) -> None:
    global _done
    if _watcher is not None:
        _watcher(event, args)
    if _done or not event.startswith("cpython.run_"):
        return
    _done = True  # one start per interpreter: every later event costs this one check
    zygote = os.getpid()
    try:
        if _config.get("version") != _VERSION:
            raise RuntimeError(
                f"the launcher's warm ranks speak version {_config.get('version')}, this "
                f"tether (its start-up hook) speaks version {_VERSION}"
            )
        if _config.get("phase") == "boot" and event == "cpython.run_command":
            _exec_zygote()
        if _config.get("phase") != "zygote" or event == "cpython.run_command":
            raise RuntimeError(f"unexpected start of the zygote ({event})")
        _enter(event, args[0])
    except BaseException as exc:  # noqa: BLE001 - never fall through to the user's script
        if os.getpid() != zygote:  # a rank whose set-up failed: its own stderr says why
            traceback.print_exc()
            os._exit(1)
        _report_and_exit(exc)


def _exec_zygote() -> None:
    """Replaces this interpreter by one started with the ranks' command line."""
    argv = [bytes.fromhex(arg) for arg in _config["argv"]]
    config = dict(_config, phase="zygote")
    env = dict(os.environb)
    env[_VARIABLE.encode()] = json.dumps(config).encode()
    for fd in _inherited_fds():
        os.set_inheritable(fd, True)
    os.execvpe(argv[0], argv, env)


def _inherited_fds() -> list:
    fds = [int(os.environ["TETHER_REPORT_FD"])]
    fds += [int(fd) for fd in os.environ["TETHER_ZYGOTE_FDS"].split(",")]
    return fds


def _enter(event: str, target: str) -> None:
    """Becomes the zygote; returns in each rank. tether's package is imported without the
    script's directory on ``sys.path`` (a module of the user's named like one of tether's
    must not stand in for it)."""
    first = sys.path.pop(0) if sys.path else None
    import _warnings

    before, filters, count = set(sys.modules), list(_warnings.filters), atexit._ncallbacks()
    registered = []
    register = atexit.register

    def note(func, *args, **kwargs):
        registered.append(func)
        return register(func, *args, **kwargs)

    atexit.register = note
    sys.modules["atexit"] = atexit  # (tether's own imports register through this one)
    try:
        from tether.run.warm import start
    finally:
        atexit.register = register
        if first is not None:
            sys.path.insert(0, first)
    # What tether's own imports did, a rank never sees.
    for func in registered:
        atexit.unregister(func)
    if count == 0:
        atexit._clear()  # (unregister leaves the count as it was)
    _warnings.filters[:] = filters
    _warnings._filters_mutated()
    before.discard("atexit")
    private = {name: sys.modules.pop(name) for name in set(sys.modules) - before}
    start.serve(_config, event, target, _set_watcher, private)


def _report_and_exit(exc: BaseException) -> None:
    """Writes a failure report on the zygote's report pipe (type name, traceback), then
    exits; never writes on the user's streams."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).encode()
    name = f"{type(exc).__module__}.{type(exc).__qualname__}".encode()
    if type(exc).__name__ == "DeclinedError":  # (tether.run.warm.start's: a reason, not a failure)
        text, name = str(exc).encode(), b"tether.ZygoteDeclined"
    body = struct.pack("<I", len(name)) + name + struct.pack("<Q", len(text)) + text
    try:
        view = memoryview(struct.pack("<Q", len(body)) + body)
        while view:
            view = view[os.write(_report_fd, view) :]
    except OSError:
        pass
    os._exit(1)
