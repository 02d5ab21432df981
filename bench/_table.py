"""Shared by the benchmarks: repeat a measurement and print medians and ratios."""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, Iterator, List, Sequence, Tuple


def repeat(fn: Callable[[], float], reps: int) -> List[float]:
    """Runs ``fn`` (which returns seconds) ``reps`` times."""
    return [fn() for _ in range(reps)]


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def print_table(
    title: str, columns: Sequence[str], rows: Sequence[Tuple[str, Sequence[str]]]
) -> None:
    """A plain-text table: a header line, then one line per row."""
    widths = [max(len(c), *(len(r[1][i]) for r in rows)) for i, c in enumerate(columns)]
    label_width = max(len(title), *(len(r[0]) for r in rows))
    print()
    print(title.ljust(label_width), *(c.rjust(w) for c, w in zip(columns, widths)), sep="  ")
    for label, cells in rows:
        print(label.ljust(label_width), *(c.rjust(w) for c, w in zip(cells, widths)), sep="  ")


def print_versus(
    title: str,
    unit: str,
    rows: Dict[str, float],
    lower_is_better: bool,
    ours: str = "tether.Pool",
    digits: int = 1,
) -> None:
    """One line per contender: its figure, and how many times better ``ours`` is."""
    reference = rows[ours]
    label = max(len(name) for name in rows)
    print(f"\n{title}")
    print(f"  {'':{label}} {unit:>14} {'tether is':>12}")
    for name, value in rows.items():
        times = value / reference if lower_is_better else reference / value
        print(f"  {name:{label}} {value:14.{digits}f} {times:10.1f}x")


def fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def ratio(reference: float, ours: float) -> str:
    """How many times faster ``ours`` is than ``reference``."""
    return f"{reference / ours:.2f}x" if ours > 0 else "inf"


Results = Dict[str, List[float]]


@contextlib.contextmanager
def busy_cores() -> Iterator[None]:
    """A process spinning on every core."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        time.sleep(0.2)
        yield
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()
