"""The ``tether`` command line: the ``tether`` console script and ``python -m tether``.

Subcommands implemented in Python are registered in :data:`COMMANDS`; every other command
line (``tether run ...``, ``--help``, ``--version``) goes to the native launcher compiled
into ``tether._native``, which lists the Python subcommands in its help. The launcher runs
in this process (it forks its own supervisor), so a wheel needs no separate executable.
Importing this module does not import torch.
"""

from __future__ import annotations

import sys
from typing import Callable, Dict, List, NamedTuple, NoReturn, Optional, Sequence


class Command(NamedTuple):
    """A subcommand implemented in Python."""

    #: One line for ``tether --help``.
    summary: str
    #: Runs the subcommand with the arguments after its name; returns the exit status.
    run: Callable[[List[str]], int]


#: Python subcommands by name (``tether ps`` and ``tether stacks`` are the launcher's own).
COMMANDS: Dict[str, Command] = {}


def main(argv: Optional[Sequence[str]] = None) -> NoReturn:
    """Runs the command line ``argv`` (``sys.argv[1:]`` by default) and exits with its
    status."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = COMMANDS.get(args[0]) if args else None
    if command is not None:
        raise SystemExit(command.run(args[1:]))
    raise SystemExit(run_native(args))


def _standard_fds() -> None:
    """Gives every closed standard fd something to stand on, so that no fd the launcher
    makes takes its number (and its ranks' output with it): a closed stderr gets stdout
    when that is open (tether's messages go where they can), anything else /dev/null."""
    import os

    def is_open(fd: int) -> bool:
        try:
            os.fstat(fd)
        except OSError:
            return False
        return True

    closed = [fd for fd in (0, 1, 2) if not is_open(fd)]
    for fd in closed:
        if fd == 2 and 1 not in closed:
            os.dup2(1, 2, inheritable=True)
            continue
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:
            os.dup2(null, fd, inheritable=True)
            os.close(null)
        else:
            os.set_inheritable(fd, True)


def run_native(args: List[str]) -> int:
    """Runs ``tether ARGS`` with the native launcher, in this process."""
    from tether import _native

    _standard_fds()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    summaries = [(name, command.summary) for name, command in sorted(COMMANDS.items())]
    return _native.cli_main(["tether", *args], sys.executable or None, summaries)


if __name__ == "__main__":
    main()
