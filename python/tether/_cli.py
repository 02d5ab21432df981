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


def _ps(args: List[str]) -> int:
    from ._status import ps_main

    return ps_main(args)


def _stacks(args: List[str]) -> int:
    from ._stacks import stacks_main

    return stacks_main(args)


#: Python subcommands by name.
COMMANDS: Dict[str, Command] = {
    "ps": Command("List the processes tether started for this user, as a tree", _ps),
    "stacks": Command("Print every rank's stack in a running `tether run` (its PID)", _stacks),
}


def main(argv: Optional[Sequence[str]] = None) -> NoReturn:
    """Runs the command line ``argv`` (``sys.argv[1:]`` by default) and exits with its
    status."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = COMMANDS.get(args[0]) if args else None
    if command is not None:
        raise SystemExit(command.run(args[1:]))
    raise SystemExit(run_native(args))


def run_native(args: List[str]) -> int:
    """Runs ``tether ARGS`` with the native launcher, in this process."""
    from tether import _native

    sys.stdout.flush()
    sys.stderr.flush()
    summaries = [(name, command.summary) for name, command in sorted(COMMANDS.items())]
    return _native.cli_main(["tether", *args], sys.executable or None, summaries)


if __name__ == "__main__":
    main()
