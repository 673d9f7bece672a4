"""The host's speed just before each timed run of a benchmark call, so that a slow round can be told from a
slow engine: a pure-Python loop's rate in the driver process (millions of iterations a second, over 50 ms).
A host whose cores are taken by other work, or clocked down, shows it for every system alike; a round that is
slow on a fast host is the engine's own.

Used by run.py (the rate of each run, and the table in the results' .md). A GPU host's speed also switches
within seconds (an idle H100: 20-22 or 37-39 M iterations/s, in stretches of 2-10 s), so run.py samples it
during each timed run too (`During`: the driver waits on a pipe meanwhile; the sampling thread takes about a
tenth of one core, for every system alike). Where the bench's busy processes outnumber the cores, that rate
also counts their contention (on the 2-core VM it halves during a run).
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any


def loop_rate(seconds: float = 0.05) -> float:
    """Millions of loop iterations a second of this process, now."""
    n, t0 = 0, time.perf_counter()
    while True:
        for _ in range(5_000):
            n += 1
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return n / dt / 1e6


class During:
    """`loop_rate` sampled every `every` s (each sample `sample` s long) in a thread while the block runs:
    `median` and `low` (the slowest sample) in M iterations/s, or None when the block was too short."""

    def __init__(self, every: float = 0.1, sample: float = 0.01) -> None:
        self.every, self.sample = every, sample
        self.rates: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.rates.append(loop_rate(self.sample))

    def __enter__(self) -> During:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def median(self) -> float | None:
        return round(statistics.median(self.rates), 2) if self.rates else None

    @property
    def low(self) -> float | None:
        return round(min(self.rates), 2) if self.rates else None


def render(result: dict) -> list[str]:
    """Per system and workload, each timed run's tok/s with the host's rate before it (`host_mips`)."""
    rows = []
    for system, entry in result.get("systems", {}).items():
        for w, runs in entry.get("runs", {}).items():
            cells = [_cell(r) for r in runs if "host_mips" in r]
            if cells:
                rows.append(f"| {system} | {w} | {' · '.join(cells)} |")
    if not rows:
        return []
    return [
        "Host speed before each timed run (a Python loop in the driver, M iterations/s) beside its tok/s, in run"
        " order, and after a slash the median of its samples during the run: a slow host slows every system"
        " alike.",
        "",
        "| system | workload | tok/s @ host M/s before / during, per run |",
        "|---|---|---|",
        *rows,
        "",
    ]


def _cell(r: dict[str, Any]) -> str:
    wall, tokens = r.get("wall"), r.get("out_tokens")
    tok_s = f"{tokens / wall:.0f}" if wall and tokens else "–"
    during = r.get("host_mips_during")
    return f"{tok_s} @ {r['host_mips']:.1f}" + ("" if during is None else f" / {during:.1f}")
