"""The ``tether`` logger. ``TETHER_LOG=info`` (or ``debug``, ...) sends tether's events to
stderr, one line each, in the same form as the native side's (``tether[PID] LEVEL name:
message``); without it, nothing is configured and nothing is printed."""

from __future__ import annotations

import logging
import os
import sys
import warnings

logger = logging.getLogger("tether")


#: The levels ``TETHER_LOG`` may name (any case), as the native side reads them.
_LEVELS = {
    "OFF": None,
    "ERROR": logging.ERROR,
    "WARN": logging.WARNING,
    "WARNING": logging.WARNING,
    "INFO": logging.INFO,
    "DEBUG": logging.DEBUG,
    "TRACE": logging.DEBUG,
}

#: Set in the processes tether starts, which leave the warning to the process that
#: started them.
_CHILD_VARS = ("TETHER_REPORT_FD", "TETHER_PAYLOAD_FD", "TETHER_STACKS_FD")


def _configure() -> None:
    raw = os.environ.get("TETHER_LOG", "")
    wanted = raw.strip().upper()
    if wanted and wanted not in _LEVELS:
        if not any(name in os.environ for name in _CHILD_VARS):
            warnings.warn(
                f"TETHER_LOG={raw!r} is not a log level (off, error, warn, info, debug, "
                "trace): nothing is logged",
                RuntimeWarning,
                stacklevel=2,
            )
        return
    level = _LEVELS.get(wanted)
    if level is None:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("tether[%(process)d] %(levelname)s %(name)s: %(message)s")
    )
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


_configure()
