"""``python -m tether ...``: the ``tether`` command line."""

from tether.run.cli import main

if __name__ == "__main__":
    main()
