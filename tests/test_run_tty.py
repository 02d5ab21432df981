"""``tether run`` on a terminal: each rank's stream that reaches it is a pseudo-terminal of
the terminal's size less its line prefix (``[rank 0]: `` takes 10 columns; ``--no-prefix``
gives the whole width), as a torchrun rank inherits the terminal itself (torchrun is the
control, run in the same test on the same pseudo-terminal); resizes reach the ranks; output
to a pipe or a log file stays a pipe; ``--no-tty``/``PET_NO_TTY`` turn it off. Also the
small promises of ``--help``: Kubernetes' form, and ``-h`` exits 0 everywhere."""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import pytest

pytestmark = pytest.mark.timeout(180)

BIN = Path(sys.executable).with_name("tether")
TORCHRUN = Path(sys.executable).with_name("torchrun")

#: What each rank prints: whether each stream is a terminal and its size, then (with WAIT)
#: the same again once a SIGWINCH came, then a last line without a newline.
PROBE = r"""
import os, signal, sys, time
got = []
signal.signal(signal.SIGWINCH, lambda *_: got.append(1))
def report(tag):
    for name, f in (("stdout", sys.stdout), ("stderr", sys.stderr)):
        try:
            size = "%dx%d" % tuple(os.get_terminal_size(f.fileno()))
        except OSError:
            size = "none"
        say(f, f"{tag} {name} tty={f.isatty()} size={size}\n")
def say(f, text):
    # One write per line: torchrun's ranks share one terminal, and print() makes two
    # writes (the text, then the newline) when Python runs unbuffered (PYTHONUNBUFFERED).
    f.write(text)
    f.flush()
report("start")
say(sys.stdout, "ready\n")
deadline = time.monotonic() + float(os.environ.get("WAIT", "0"))
while not got and time.monotonic() < deadline:
    time.sleep(0.02)
if got:
    report("winch")
say(sys.stdout, "bye")
"""

LINE = re.compile(r"^(?:\[rank (\d+)\]: )?(start|winch) (stdout|stderr) tty=(\w+) size=(\S+)")

#: rank (None without a prefix) -> set of (phase, stream, tty, size)
Seen = Dict[Optional[int], Set[Tuple[str, str, str, str]]]


def seen(text: str) -> Seen:
    found: Seen = {}
    for line in text.splitlines():
        match = LINE.match(line)
        if match:
            rank, phase, stream, tty, size = match.groups()
            key = None if rank is None else int(rank)
            found.setdefault(key, set()).add((phase, stream, tty, size))
    return found


def set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def on_terminal(
    argv: List[str],
    tmp: Path,
    env: Optional[Dict[str, str]] = None,
    stderr_file: Optional[Path] = None,
    resize_after: int = 0,
) -> Tuple[int, str]:
    """Runs ``argv`` with stdout and stderr on a new 37x123 pseudo-terminal (stderr to
    ``stderr_file`` when given) and returns its exit status and what the terminal showed
    (line ends as the program wrote them). With ``resize_after``, once that many ``ready``
    lines showed, the terminal becomes 50x99 and the program gets SIGWINCH, as a terminal
    sends it to its foreground process group."""
    script = tmp / "probe.py"
    script.write_text(PROBE)
    master, slave = os.openpty()
    set_size(master, 37, 123)
    err = open(stderr_file, "wb") if stderr_file else None
    try:
        proc = subprocess.Popen(
            [*argv, str(script)],
            stdin=subprocess.DEVNULL,
            stdout=slave,
            stderr=err or slave,
            env=dict(os.environ, **(env or {})),
            cwd=tmp,
        )
    finally:
        os.close(slave)
        if err:
            err.close()
    shown = b""
    resized = False
    deadline = time.monotonic() + 150
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every holder of the terminal closed it
                    break
                if not chunk:
                    break
                shown += chunk
            if resize_after and not resized and shown.count(b"ready") >= resize_after:
                set_size(master, 50, 99)
                proc.send_signal(signal.SIGWINCH)
                resized = True
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    # The outer terminal turns each "\n" into "\r\n" (ONLCR), as a real one does.
    return code, shown.decode(errors="replace").replace("\r\n", "\n")


def tether(*args: str) -> List[str]:
    return [str(BIN), "run", *args]


#: What a torchrun rank sees on the 37x123 terminal.
TORCHRUN_SEES = {
    ("start", "stdout", "True", "123x37"),
    ("start", "stderr", "True", "123x37"),
}
#: What a tether rank sees there: 10 columns fewer, for its prefix ``[rank 0]: ``.
ON_A_TERMINAL = {
    ("start", "stdout", "True", "113x37"),
    ("start", "stderr", "True", "113x37"),
}


def test_ranks_see_the_terminal_and_its_size_as_torchruns_ranks_do(tmp_path: Path) -> None:
    # torchrun leaves its torchelastic_* directory behind: in the test's own directory.
    torchrun = [str(TORCHRUN), "--nproc-per-node", "2"]
    code, shown = on_terminal(torchrun, tmp_path, env={"TMPDIR": str(tmp_path)})
    assert code == 0, shown
    # torchrun's ranks share the terminal unprefixed: both ranks' lines, the same ones.
    assert seen(shown) == {None: TORCHRUN_SEES}, shown
    for warm in ([], ["--no-warm"]):
        code, shown = on_terminal(tether("-n", "2", *warm), tmp_path)
        assert code == 0, shown
        assert seen(shown) == {0: ON_A_TERMINAL, 1: ON_A_TERMINAL}, (warm, shown)
        # Each rank's line without a newline is shown, on a line of its own, after it exits.
        assert shown.count("[rank 0]: bye\n") == 1 and shown.count("[rank 1]: bye\n") == 1
        # The pty adds no "\r" of its own: the only line ends are the rank's newlines.
        assert "\r" not in shown, repr(shown)


def test_a_resize_of_the_terminal_reaches_every_rank(tmp_path: Path) -> None:
    code, shown = on_terminal(tether("-n", "2"), tmp_path, env={"WAIT": "60"}, resize_after=2)
    assert code == 0, shown
    resized = {
        ("winch", "stdout", "True", "89x50"),
        ("winch", "stderr", "True", "89x50"),
    }
    assert seen(shown) == {0: ON_A_TERMINAL | resized, 1: ON_A_TERMINAL | resized}, shown


def test_under_no_prefix_a_rank_has_the_whole_width_after_a_resize_too(tmp_path: Path) -> None:
    argv = tether("-n", "1", "--no-prefix")
    code, shown = on_terminal(argv, tmp_path, env={"WAIT": "60"}, resize_after=1)
    assert code == 0, shown
    resized = {("winch", "stdout", "True", "99x50"), ("winch", "stderr", "True", "99x50")}
    assert seen(shown) == {None: TORCHRUN_SEES | resized}, shown


def test_output_to_a_pipe_stays_a_pipe(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    proc = subprocess.run(
        tether("-n", "2", str(script)),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    piped = {("start", "stdout", "False", "none"), ("start", "stderr", "False", "none")}
    assert seen(proc.stdout + proc.stderr) == {0: piped, 1: piped}, proc


def test_only_the_stream_on_the_terminal_is_a_terminal(tmp_path: Path) -> None:
    err = tmp_path / "err.txt"
    code, shown = on_terminal(tether("-n", "1"), tmp_path, stderr_file=err)
    assert code == 0, shown + err.read_text()
    assert seen(shown + err.read_text()) == {
        0: {("start", "stdout", "True", "113x37"), ("start", "stderr", "False", "none")}
    }


@pytest.mark.parametrize(
    "how",
    [(["--no-tty"], {}), (["--no_tty"], {}), ([], {"PET_NO_TTY": "1"})],
    ids=["--no-tty", "--no_tty", "PET_NO_TTY=1"],
)
def test_no_tty_gives_the_ranks_pipes_on_a_terminal(
    tmp_path: Path, how: Tuple[List[str], Dict[str, str]]
) -> None:
    flags, env = how
    code, shown = on_terminal(tether("-n", "1", *flags), tmp_path, env=env)
    assert code == 0, shown
    piped = {("start", "stdout", "False", "none"), ("start", "stderr", "False", "none")}
    assert seen(shown) == {0: piped}, shown


def test_streams_teed_to_log_files_are_pipes_and_log_files_keep_plain_bytes(
    tmp_path: Path,
) -> None:
    logs = tmp_path / "logs"
    # --tee 1: stdout goes to a log file too (torchrun's rank writes it to that file).
    code, shown = on_terminal(
        tether("-n", "1", "--tee", "1", "--log-dir", str(logs), "--rdzv-id", "teed"), tmp_path
    )
    assert code == 0, shown
    assert seen(shown) == {
        0: {("start", "stdout", "False", "none"), ("start", "stderr", "True", "113x37")}
    }, shown
    # --log-dir alone sends nothing to a file under torchrun: the rank keeps a terminal, and
    # tether's copy in the log file is the program's own bytes.
    code, shown = on_terminal(
        tether("-n", "1", "--log-dir", str(logs), "--rdzv-id", "plain"), tmp_path
    )
    assert code == 0, shown
    assert seen(shown) == {0: ON_A_TERMINAL}, shown
    [out_log] = logs.glob("plain/attempt_0/rank_0/stdout.log")
    assert out_log.read_bytes() == b"start stdout tty=True size=113x37\nready\nbye"


def test_run_help_names_kubernetes_form_beside_slurms() -> None:
    out = subprocess.run([str(BIN), "run", "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for words in ["srun", "SLURM", "Kubernetes' PyTorchJob", "PET_NNODES=MIN:MAX", "--no-tty"]:
        assert words in text, words


def test_dash_h_exits_0_for_tether_and_every_subcommand() -> None:
    top = subprocess.run([str(BIN), "-h"], capture_output=True, text=True, timeout=30)
    assert top.returncode == 0, top.stderr
    commands = top.stdout.split("Commands:")[1].split("Options:")[0]
    names = [line.split()[0] for line in commands.splitlines() if re.match(r"  \S", line)]
    assert {"run", "ps", "stacks", "help"} <= set(names), names
    for name in names:
        for flag in ("-h", "--help"):
            out = subprocess.run([str(BIN), name, flag], capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, (name, flag, out.stdout, out.stderr)
            assert out.stdout.strip(), (name, flag)
