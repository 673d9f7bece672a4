"""Which threads of the host burn CPU while a bench runs beside it: every `--every` s, each thread (of any
process) that used more than `--min` % of a core over the interval, as pid/tid/name@last core:percent (the
tid matches `lens_rusage`'s thread names); and once per process the cores it may run on. It tells a
busy-polling neighbour, a torch pool spinning after its region or two processes pinned to one core from the
tail's own work.

    python bench/probes/thread_top.py [--every 1] [--min 5] [--seconds 600] > threads.log &
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _stat(path: Path) -> tuple[str, int, int] | None:
    """(thread name, utime + stime ticks, last core) of one /proc/<pid>/task/<tid>/stat."""
    try:
        raw = path.read_text()
    except OSError:
        return None
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    rest = raw[raw.rindex(")") + 2 :].split()
    return name, int(rest[11]) + int(rest[12]), int(rest[36])


def _sample() -> dict[tuple[int, int], tuple[str, int, int]]:
    got = {}
    for task in Path("/proc").glob("[0-9]*/task/[0-9]*"):
        s = _stat(task / "stat")
        if s is not None:
            got[(int(task.parent.parent.name), int(task.name))] = s
    return got


def _process(pid: int) -> str:
    try:
        cmd = (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))[:80]
        cores = next(
            line.split(":")[1].strip()
            for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            if line.startswith("Cpus_allowed_list")
        )
    except (OSError, StopIteration):
        return f"pid {pid} (gone)"
    return f"pid {pid} cores {cores} {cmd}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--every", type=float, default=1.0)
    ap.add_argument("--min", type=float, default=5.0, help="percent of one core")
    ap.add_argument("--seconds", type=float, default=600.0)
    a = ap.parse_args()
    seen: set[int] = set()
    prev, t_prev = _sample(), time.monotonic()
    end = t_prev + a.seconds
    while time.monotonic() < end:
        time.sleep(a.every)
        cur, t = _sample(), time.monotonic()
        dt = t - t_prev
        busy = []
        for key, (name, ticks, core) in cur.items():
            old = prev.get(key)
            pct = 100.0 * (ticks - (old[1] if old else ticks)) / TICK / dt
            if pct >= a.min:
                busy.append((pct, key, name, core))
        for pid in sorted({k[0] for _, k, _, _ in busy} - seen):
            seen.add(pid)
            print("PROC", _process(pid), flush=True)
        cells = " ".join(
            f"{pid}/{tid}/{name}@{core}:{pct:.0f}" for pct, (pid, tid), name, core in sorted(busy, reverse=True)
        )
        print(f"T {time.strftime('%H:%M:%S')} {cells}", flush=True)
        prev, t_prev = cur, t


if __name__ == "__main__":
    main()
