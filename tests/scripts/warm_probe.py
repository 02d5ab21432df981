"""``python -u warm_probe.py OUT``: the probe of warm ranks (see ``warm_pkg.record``)."""

from warm_pkg.record import run

if __name__ == "__main__":
    run()
