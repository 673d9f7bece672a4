"""The host's CPU as the bench's processes see it: the cores this process may run on, the cgroup's CPU quota,
and a pure-Python loop's rate in 1, 2, 4 and 8 processes at once (each process's rate against one alone: a
quota or shared cores show as a rate that falls with the count, not a flat one). Host work in two processes
(the engine core's result assembly beside the frontend's decoding) contends only if that falls.

    python bench/probes/host_cpu.py   -> one JSON line
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # bench/: the bench's own loop

from host_speed import loop_rate  # noqa: E402


def _loop(seconds: float, out: mp.Queue) -> None:
    out.put(loop_rate(seconds) * 1e6)


def rates(k: int, seconds: float = 1.0) -> list[float]:
    """Loop iterations per second of each of `k` processes run at once."""
    q: mp.Queue = mp.Queue()
    ps = [mp.Process(target=_loop, args=(seconds, q)) for _ in range(k)]
    for p in ps:
        p.start()
    got = [q.get() for _ in ps]
    for p in ps:
        p.join()
    return got


def main() -> dict:
    quota = None
    for f in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        if Path(f).exists():
            quota = Path(f).read_text().strip()
            break
    alone = rates(1)[0]
    out = {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "cgroup_quota": quota}
    for k in (1, 2, 4, 8):
        r = rates(k)
        out[f"procs_{k}_rate_vs_alone"] = [round(x / alone, 2) for x in r]
    out["alone_iter_per_s"] = round(alone)
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
