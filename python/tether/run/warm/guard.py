"""A warm zygote's preload: each package the script imports (``scan``) is imported
under record (``record``), then undone, so that a rank sees it only from its own
import on (``run.warm.serve``). A package is left to the ranks (each imports it itself, as a
new interpreter does; the zygote starts again without it) when its import, or one it made:

- did what belongs to one process only: opened a file or socket and keeps it, left a thread
  or a process running, made a temporary file, read the clock, random numbers or the process
  id (the standard library's own imports excepted, which each rank gets afresh), initialized
  CUDA;
- read what certainly differs in a rank: a variable of a rank's own (``RANK``,
  ``LOCAL_RANK``, ...), the whole environment, ``__main__``'s attributes;
- changed what tether cannot undo for the ranks that do not import it: the environment,
  ``sys.path``, the working directory, settings of the interpreter or of a library it knows
  (torch's default dtype, ...), the root logger's configuration;
- imported a module of the user's, or loaded compiled code although the script imports it
  only after code that may change what it reads (see ``scan``); or failed.

The interpreter's start-up hooks (``sitecustomize``, ``usercustomize``, code in ``.pth``
files) ran in the zygote, with its environment: ``startup_hooks`` runs them again under
record in a throwaway fork, and says why warm ranks cannot be when they read what differs
in a rank, or do what belongs to one process only."""

from __future__ import annotations

import atexit
import os
import site
import sys
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

from . import probes, record, scan
from .nodes import Node


class Found(NamedTuple):
    """What the preload did: the modules imported, those to leave to the ranks (with why),
    those whose import failed (with the error), and the installed packages that the
    imports of modules left out brought in (worth preloading on their own: torch, under a
    package that reads ``RANK``)."""

    preloaded: List[str]
    left_out: List[Tuple[str, str]]
    failed: List[Tuple[str, str]]
    beneath: List[str]


def preload(
    modules: Sequence[str],
    prefix: Set[str],
    varying: Set[str],
    set_audit: Optional[Callable[[Any], None]],
) -> Tuple[Found, Dict[str, Node]]:
    """Imports each of ``modules`` under record (``prefix``: those the script imports in its
    prefix; ``varying``: the variables that differ between ranks); what it found, and each
    module's node."""
    found = Found([], [], [], [])
    recorder = record.Recorder(scan.Places(), varying)
    recorder.witness.set_audit = set_audit
    none_before = atexit._ncallbacks() == 0
    with recorder:
        for name in modules:
            _one(name, name in prefix, recorder, found)
    if none_before:
        atexit._clear()  # (unregister leaves the count as it was)
    return found, recorder.owner


def _one(name: str, prefix: bool, recorder: record.Recorder, found: Found) -> None:
    recorder.created = []
    try:
        recorder.root(name)
        error = None
    except BaseException as exc:  # noqa: BLE001 - an import may even call sys.exit
        error = f"{type(exc).__name__}: {exc}"
    created: List[Node] = recorder.created
    problems = [why for node in created for why in node.problems]
    if error is not None and not problems:
        found.failed.append((name, error))
        return
    natives = [node.name for node in created if node.native]
    if natives and not prefix:
        problems.append(
            f"it loads compiled code ({natives[0]}), and the script imports it only after "
            "code that may change what that code reads"
        )
    if not problems:
        found.preloaded.append(name)
        return
    found.left_out.append((name, problems[0]))
    if all(why.startswith("its import read") for why in problems):
        top = name.partition(".")[0]
        clean = {n.package for n in created if not any(x.problems for x in n.tree())}
        found.beneath.extend(sorted(p for p in clean if p != top and record.installed(p)))


def startup_hooks(varying: Set[str]) -> Optional[str]:
    """Why warm ranks cannot be, given the interpreter's start-up hooks (None when they
    may): each hook runs again under record, in a throwaway fork of this process."""
    hooks = _hooks()
    if not hooks:
        return None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            os.write(write, (_run_hooks(hooks, varying) or "").encode())
        finally:
            os._exit(0)
    os.close(write)
    chunks = []
    while True:
        chunk = os.read(read, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode() or None


def _hooks() -> List[Tuple[str, str]]:
    """The start-up hooks this interpreter ran: (where, code) of each code line of a
    ``.pth`` file (tether's own aside), then ``sitecustomize`` and ``usercustomize``."""
    folders = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        folders.insert(0, site.getusersitepackages())
    hooks = []
    for folder in folders:
        try:
            names = sorted(n for n in os.listdir(folder) if n.endswith(".pth"))
        except OSError:
            continue
        for name in names:
            if name.startswith("tether_"):
                continue
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    lines = f.read().splitlines()
            except (OSError, UnicodeDecodeError):
                continue
            hooks += [(name, line) for line in lines if line.startswith(("import ", "import\t"))]
    for module in ("sitecustomize", "usercustomize"):
        if module in sys.modules:
            hooks.append((module, f"import {module}"))
    return hooks


def _run_hooks(hooks: List[Tuple[str, str]], varying: Set[str]) -> Optional[str]:
    """In the throwaway fork: runs every hook again under record; why they keep warm ranks
    off, or None."""
    recorder = record.Recorder(scan.Places(), varying)
    recorder.created = []
    fds, children = probes.fds(), len(probes.children())
    for where, code in hooks:
        if code.startswith("import ") and code.split()[1] in ("sitecustomize", "usercustomize"):
            sys.modules.pop(code.split()[1], None)
        node = Node(where)
        with recorder:
            recorder.stack.append(node)
            try:
                exec(code, {"__name__": where})
            except BaseException:  # noqa: BLE001 - the interpreter went on without it
                pass
            finally:
                recorder.stack.pop()
        problems = node.problems + [w for n in recorder.created for w in n.problems]
        why = [w.replace("its import ", "it ") for w in problems if "changed" not in w]
        if probes.fds() - fds - recorder.witness.output.fds():
            why.append("it opens a file and keeps it open")
        if len(probes.children()) > children:
            why.append("it starts a process")
        if why:
            return f"a start-up hook ({where}) would run in the zygote only, and {why[0]}"
    return None
