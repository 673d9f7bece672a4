"""The host's speed just before each timed run of a benchmark call, so that a slow round can be told from a
slow engine: a pure-Python loop's rate in the driver process (millions of iterations a second, over 50 ms).
A host whose cores are taken by other work, or clocked down, shows it for every system alike; a round that is
slow on a fast host is the engine's own.

Used by run.py (the rate of each run, and the table in the results' .md).
"""

from __future__ import annotations

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
        " order: a slow host slows every system alike.",
        "",
        "| system | workload | tok/s @ host M/s, per run |",
        "|---|---|---|",
        *rows,
        "",
    ]


def _cell(r: dict[str, Any]) -> str:
    wall, tokens = r.get("wall"), r.get("out_tokens")
    tok_s = f"{tokens / wall:.0f}" if wall and tokens else "–"
    return f"{tok_s} @ {r['host_mips']:.1f}"
