"""``python -u -m warm_pkg.probe OUT``: the probe, run as a module (a relative import)."""

from .record import run

if __name__ == "__main__":
    run()
