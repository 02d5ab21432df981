"""A full-width progress bar under ``tether run`` on a terminal redraws in place, as under
torchrun: rendered by a terminal emulator (pyte) of 100 columns, a tqdm-like bar that fills
the rank's terminal (``\\r`` then exactly its width) ends as one line on the screen, prefix
included; torchrun, whose rank writes to the terminal itself, is the control."""

from __future__ import annotations

import fcntl
import os
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import List

import pytest

pyte = pytest.importorskip("pyte")

pytestmark = pytest.mark.timeout(120)

BIN = Path(sys.executable).with_name("tether")
COLS, ROWS = 100, 20

#: A bar as tqdm draws it: the terminal's width at each step, redrawn after a "\r".
BAR = r"""
import os, sys, time
cols = os.get_terminal_size(sys.stderr.fileno()).columns
for i in range(1, 6):
    left, right = f"{i * 20:3d}%|", f"| {i}/5"
    fill = cols - len(left) - len(right)
    sys.stderr.write("\r" + left + "#" * (fill * i // 5) + " " * (fill - fill * i // 5) + right)
    sys.stderr.flush()
    time.sleep(0.05)
sys.stderr.write("\n")
"""


def rendered(argv: List[str], tmp: Path) -> List[str]:
    """The screen's non-blank lines once ``argv`` ran on a 20x100 pseudo-terminal."""
    script = tmp / "bar.py"
    script.write_text(BAR)
    master, slave = os.openpty()
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
    env = dict(os.environ, TMPDIR=str(tmp))
    try:
        proc = subprocess.Popen(
            [*argv, str(script)],
            stdin=subprocess.DEVNULL,
            stdout=slave,
            stderr=slave,
            env=env,
            cwd=tmp,
        )
    finally:
        os.close(slave)
    screen = pyte.Screen(COLS, ROWS)
    stream = pyte.ByteStream(screen)
    deadline = time.monotonic() + 100
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if not ready:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every holder of the terminal closed it
                break
            if not chunk:
                break
            stream.feed(chunk)
        assert proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return [line.rstrip() for line in screen.display if line.strip()]


def test_a_full_width_bar_ends_on_one_line_with_its_prefix_as_under_torchrun(
    tmp_path: Path,
) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
    control = rendered(torchrun, tmp_path)
    assert len(control) == 1 and len(control[0]) == COLS, control
    assert control[0].startswith("100%|") and control[0].endswith("| 5/5"), control
    shown = rendered([str(BIN), "run", "-n", "1"], tmp_path)
    assert shown == [f"[rank 0]: {control[0][:4]}" + shown[0][14:]], shown
    assert len(shown[0]) == COLS and shown[0].endswith("| 5/5"), shown


def test_under_no_prefix_the_bar_is_torchruns_own(tmp_path: Path) -> None:
    shown = rendered([str(BIN), "run", "-n", "1", "--no-prefix"], tmp_path)
    assert len(shown) == 1 and len(shown[0]) == COLS, shown
    assert shown[0].startswith("100%|") and shown[0].endswith("| 5/5"), shown
