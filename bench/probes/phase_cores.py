"""Whether a host's slow and fast phases are the whole machine's or each core's: one process pinned to each
of a few cores samples a Python loop's rate (`bench/host_speed.loop_rate`, 0.25 s samples) for the same
seconds; then, per core, its series and how often it was in the same phase (fast: >= `FAST` M iterations/s)
as the first core. Whole-machine phases would let a sample in the bench's driver stand for the engines'
cores; each core's own would not.

    python bench/probes/phase_cores.py [seconds] [cores, e.g. 0,5,10,15]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # bench/: the bench's own loop

from host_speed import loop_rate  # noqa: E402

FAST = 30.0  # M iterations/s: the GPU hosts' loop runs at ~18-22 or ~35-39


def _sample(core: int, t_end: float, q: mp.Queue) -> None:
    os.sched_setaffinity(0, {core})
    out = []
    while time.time() < t_end:
        out.append(round(loop_rate(0.25), 1))
    q.put((core, out))


def main(seconds: float, cores: list[int]) -> None:
    t_end = time.time() + seconds
    q: mp.Queue = mp.Queue()
    ps = [mp.Process(target=_sample, args=(c, t_end, q)) for c in cores]
    for p in ps:
        p.start()
    got = dict(q.get() for _ in ps)
    for p in ps:
        p.join()
    n = min(len(v) for v in got.values())
    fast = {c: [r >= FAST for r in got[c][:n]] for c in cores}
    for c in cores:
        same = sum(a == b for a, b in zip(fast[cores[0]], fast[c])) / max(n, 1)
        print(
            f"core {c}: fast in {sum(fast[c]) / max(n, 1):.2f} of {n} samples, in core {cores[0]}'s phase in {same:.2f}"
        )
        print("  ", got[c])


if __name__ == "__main__":
    secs = float(sys.argv[1]) if len(sys.argv) > 1 else 40.0
    cs = [int(c) for c in sys.argv[2].split(",")] if len(sys.argv) > 2 else [0, 5, 10, 15]
    main(secs, [c for c in cs if c in os.sched_getaffinity(0)])
