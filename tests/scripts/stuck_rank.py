"""A ``tether run`` rank stuck in the place its rank picks (see ``tests/stuck.py``); it prints
``ready PID`` first. ``--only KIND`` puts every rank in the same place."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import stuck

rank = int(os.environ["RANK"])
kinds = stuck.KINDS if "--only" not in sys.argv else (sys.argv[sys.argv.index("--only") + 1],)
print(f"ready {os.getpid()}", flush=True)
stuck.stuck_here(kinds[rank % len(kinds)])
