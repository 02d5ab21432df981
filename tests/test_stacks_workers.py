"""``tether stacks PID`` shows each rank's DataLoader workers under the rank, whether fork
started them or a ``tether.Pool`` serves the loader (whose workers answer to the rank, not
to the launcher), and its summary says that the rank waits on them and where they are; the
pool's idle helpers (its zygote and blanks) are not shown as workers."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Tuple

import pytest

from conftest import descendants, wait_gone

pytestmark = pytest.mark.timeout(180)

BIN = Path(sys.executable).with_name("tether")

JOB = """
import sys, time
import torch
from torch.utils.data import DataLoader, Dataset
import tether

class Stuck(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        print("in getitem", flush=True)
        time.sleep(1000)

if __name__ == "__main__":
    context = tether.Pool(2).context() if sys.argv[1] == "pool" else "fork"
    for batch in DataLoader(Stuck(), num_workers=2, multiprocessing_context=context):
        pass
"""

#: The lines of JOB (counted from the script's first line) where the workers wait, and where
#: the rank does.
STUCK_LINE = JOB.splitlines().index("        time.sleep(1000)") + 1
LOOP_LINE = next(n for n, line in enumerate(JOB.splitlines(), 1) if "for batch in" in line)


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@pytest.fixture(params=["fork", "pool"])
def job(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tuple[str, int, str]]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / "job.out"
    with open(out, "w") as outf, open(tmp_path / "job.err", "w") as errf:
        proc = subprocess.Popen(
            [str(BIN), "run", "-n", "1", "--no-watch", str(script), request.param],
            stdout=outf,
            stderr=errf,
            stdin=subprocess.DEVNULL,
            cwd=tmp_path,
        )
    deadline = time.monotonic() + 90
    while out.read_text().count("in getitem") < 2:
        err = (tmp_path / "job.err").read_text()
        assert proc.poll() is None and time.monotonic() < deadline, err
        time.sleep(0.1)
    everything = sorted(descendants(proc.pid))
    try:
        yield request.param, proc.pid, str(script)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert wait_gone(everything, 10) == []


def test_each_ranks_workers_show_under_it_and_the_summary_says_where_they_wait(job) -> None:
    kind, launcher, script = job
    done = subprocess.run(
        [str(BIN), "stacks", str(launcher)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    block = done.stdout
    workers = [pid for pid in descendants(launcher) if command(pid) == "pt_data_worker"]
    assert len(workers) == 2, block
    header = "a worker of this rank's tether.Pool" if kind == "pool" else "a process this rank"
    for pid in workers:
        at = block.index(f"[rank 0]: -- {header}")
        assert f": pid {pid} (pt_data_worker)" in block[at:], block
    where = f'File "{script}", line {STUCK_LINE} in __getitem__'
    assert block.count(where) == 2, block
    assert "tether-zygote" not in block and "tether-blank" not in block, block
    summary = block.strip().splitlines()[-1]
    rank = f"tether: summary: rank 0 waits in __next__ called from job.py:{LOOP_LINE};"
    assert summary.startswith(rank), summary
    said = re.search(r"rank 0 waits on its DataLoader workers: (.*)$", summary)
    assert said, summary
    places = sorted(said.group(1).split(", "))
    assert places == sorted(f"pid {pid} at job.py:{STUCK_LINE} in __getitem__" for pid in workers)
