"""What resizing torch's intra-op pool costs on this host, and whether it builds up: a step loop of
`--rounds` x `--steps` steps, each with the work a GPU engine core's step thread does on the host (a torch
copy above the parallel grain, run by the pool) and a sleep for the device, under four modes:
`none` (no resize), `every` (`torch.set_num_threads(1)` / back at every step, as the worker's step hook
did), `replan` (the same, at every `--replan-every`-th step only) and `omp` (only the calling thread's
OpenMP setting, `omp_set_num_threads`, through the libgomp torch loaded). Per round: the step thread's
CPU, the process's CPU, the pair of resizes' mean cost, the threads the process has.

    python bench/probes/pool_toggle.py [--rounds 5 --steps 130]   -> one JSON line per mode and round
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import time
from typing import Any, Callable

import torch


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _omp_lib() -> Any:
    """The OpenMP runtime torch loaded (its path from this process's mappings), or None."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "gomp" in line or "libiomp" in line}
    for p in sorted(paths):
        if p.startswith("/"):
            return ctypes.CDLL(p)
    return None


def _resize(mode: str, n: int, omp: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    if mode == "omp":
        return (lambda: omp.omp_set_num_threads(1)), (lambda: omp.omp_set_num_threads(n))
    return (lambda: torch.set_num_threads(1)), (lambda: torch.set_num_threads(n))


def run(mode: str, rounds: int, steps: int, replan_every: int, sleep_s: float, omp: Any) -> list[dict]:
    n = torch.get_num_threads()
    src = torch.randn(64, 4096)
    dst = torch.empty(64, 4096)
    small = torch.randn(32, 4096)
    down, up = _resize(mode, n, omp)
    out = []
    for r in range(rounds):
        t_thread, t_wall = time.thread_time(), time.perf_counter()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        pair = 0.0
        pairs = 0
        for s in range(steps):
            toggle = mode in ("every", "omp") or (mode == "replan" and s % replan_every == 0)
            if toggle:
                t = time.perf_counter()
                down()
                t1 = time.perf_counter()
                small.abs().amax(dim=1).tolist()  # the plan's row work, in one thread
                t2 = time.perf_counter()
                up()
                pair += t1 - t + time.perf_counter() - t2
                pairs += 1
            dst.copy_(src)  # host work above the grain: the pool
            (src * 2).sum()
            time.sleep(sleep_s)
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        out.append(
            {
                "mode": mode,
                "round": r,
                "wall_s": round(time.perf_counter() - t_wall, 4),
                "step_thread_cpu_s": round(time.thread_time() - t_thread, 4),
                "process_cpu_s": round(ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime, 4),
                "pair_us": round(pair / max(pairs, 1) * 1e6, 1),
                "threads": _threads(),
                "num_threads": torch.get_num_threads(),
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=130)
    ap.add_argument("--replan-every", type=int, default=25)
    ap.add_argument("--sleep-ms", type=float, default=10.0)
    ap.add_argument("--modes", default="none,every,replan,omp,none")
    args = ap.parse_args()
    torch.randn(1 << 20).sum()  # the pool made
    omp = _omp_lib()
    info = {
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "num_threads": torch.get_num_threads(),
        "threads": _threads(),
        "omp_lib": getattr(omp, "_name", None),
        "parallel": [x for x in torch.__config__.parallel_info().splitlines() if "backend" in x],
    }
    print(json.dumps(info), flush=True)
    for mode in args.modes.split(","):
        if mode == "omp" and omp is None:
            continue
        for row in run(mode, args.rounds, args.steps, args.replan_every, args.sleep_ms / 1e3, omp):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
