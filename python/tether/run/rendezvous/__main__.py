"""``python -m tether.run.rendezvous``: the rendezvous helper of ``tether run``."""

import sys

from .helper import main

main(sys.argv)
