"""The ``tether`` logger. ``TETHER_LOG=info`` (or ``debug``, ...) sends tether's events to
stderr, one line each, in the same form as the native side's (``tether[PID] LEVEL name:
message``); without it, nothing is configured and nothing is printed."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("tether")


def _configure() -> None:
    wanted = os.environ.get("TETHER_LOG", "").strip().upper()
    level = logging.getLevelName(wanted) if wanted else None
    if not isinstance(level, int):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("tether[%(process)d] %(levelname)s %(name)s: %(message)s")
    )
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


_configure()
