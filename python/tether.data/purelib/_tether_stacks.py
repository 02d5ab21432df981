"""tether's stack dump handler in the Python processes that ``tether run`` starts, loaded at
interpreter start-up by ``tether_stacks.pth`` only when ``TETHER_STACKS_FD`` or
``TETHER_JOB_ID`` is set (in every other process the ``.pth`` line costs two lookups in
``os.environ``).

``tether run`` starts a rank as ``python -u SCRIPT`` or ``python -u -m MODULE``, as torchrun
does, and leaves that command line as it is. It passes its stacks channel instead: an fd and
its socket's inode, ``FD:INODE`` in ``TETHER_STACKS_FD``, on which this module registers the
handler that answers the launcher's requests for the rank's stacks, as ``tether.spawn.bootstrap``
does in tether's own children. A value that names no such socket (a stray variable in some
other program) installs nothing and changes no fd. The variable is removed, so that the
rank's own Python children do not take an fd they do not hold; so is the job's id
(``TETHER_JOB_ID``, under which ``tether.share``'s key form meets), which tether's module
keeps, so that the rank's environment is the one torchrun gives. Only tether's compiled
module is loaded: importing the ``tether`` package would cost every rank tens of
milliseconds."""

import os
import sys

_VARIABLE = "TETHER_STACKS_FD"
#: The job's id on this machine (``tether.share``'s key form meets under it).
_JOB = "TETHER_JOB_ID"


def install() -> None:
    """Registers the handler on the fd that ``TETHER_STACKS_FD`` names, and takes the job's
    id out of the environment into tether's module (a rank's environment and modules are then
    what torchrun gives it); any failure leaves the process as it was (it only cannot show its
    stacks, or meet its job's other ranks in ``tether.share``)."""
    value = os.environ.pop(_VARIABLE, None)
    job = os.environ.pop(_JOB, None)
    before = set(sys.modules)
    try:
        native = _native()
        if job:
            native.share_enter_job(job)  # type: ignore[attr-defined]
        if value is not None:
            fd, _, inode = value.partition(":")
            native.install_stack_handler(int(fd), int(inode))  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - a debugging aid must never stop a program's start
        pass
    # What this loaded is tether's: the program's sys.modules is python's own (importing
    # tether later gets the same compiled module).
    for name in set(sys.modules) - before | {__name__}:
        sys.modules.pop(name, None)


def _native() -> object:
    """``tether._native``, loaded without running the package's ``__init__`` (with the
    import system's own functions: ``importlib.util`` alone would cost milliseconds)."""
    module = sys.modules.get("tether._native")
    if module is not None:
        return module
    import _frozen_importlib
    import _frozen_importlib_external

    finder = _frozen_importlib_external.PathFinder
    # Installed from a wheel, the package sits beside this module: no search of sys.path.
    beside = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tether")
    spec = finder.find_spec("tether._native", [beside])
    if spec is None:
        package = finder.find_spec("tether")
        if package is None or not package.submodule_search_locations:
            raise ImportError("tether is not installed")
        spec = finder.find_spec("tether._native", list(package.submodule_search_locations))
    if spec is None or spec.loader is None:
        raise ImportError("tether._native is not installed")
    module = _frozen_importlib.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
