"""The ``tether`` console script: hands the command line to the native ``tether`` binary.

The binary ships inside the package (``tether/bin/tether``); ``TETHER_BIN`` names another
one. Importing this module does not import torch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENV_VAR = "TETHER_BIN"


def find_binary() -> Path | None:
    """The ``tether`` binary next to the package, else the one ``$TETHER_BIN`` names."""
    bundled = Path(__file__).parent / "bin" / "tether"
    if bundled.is_file() and os.access(bundled, os.X_OK):
        return bundled
    override = os.environ.get(ENV_VAR)
    if override:
        path = Path(override)
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


def main() -> None:
    """Replaces this process with the native binary, passing ``sys.argv[1:]`` unchanged."""
    binary = find_binary()
    if binary is None:
        bundled = Path(__file__).parent / "bin" / "tether"
        sys.stderr.write(
            f"tether: the native launcher is missing: no executable at {bundled}"
            f" and ${ENV_VAR} is {os.environ.get(ENV_VAR)!r}.\n"
            "Reinstall the tether wheel, or build it with"
            " `cargo build --release -p tether-cli` and set"
            f" {ENV_VAR}=target/release/tether.\n"
        )
        raise SystemExit(127)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(binary, [str(binary), *sys.argv[1:]])


if __name__ == "__main__":
    main()
