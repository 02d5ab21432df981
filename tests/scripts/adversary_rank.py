"""A ``tether run`` rank that puts a socket or a file of its own under the number of every
socket fd it holds (tether's stacks channel among them), then works until a ``stop`` file
appears (see ``tests/adversary.py``): ``adversary_rank.py DIR socket|file``."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import adversary

adversary.reuse_channel(int(os.environ["RANK"]), sys.argv[1], sys.argv[2])
