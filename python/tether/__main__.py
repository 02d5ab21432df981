"""``python -m tether ...``: the ``tether`` command line."""

from tether._cli import main

if __name__ == "__main__":
    main()
