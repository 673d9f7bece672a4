"""What the mlp_post tap costs when nothing is asked: kernel launches per tap, and the host time of one call.

    PYTHONPATH=. .venv/bin/python bench/probes/tap_idle_cost.py [--d 4096 --d-mlp 14336] [--reps 7]

No engine: the worker's `graph.GraphTaps` for one model shape (default the 8B shape of the H200 runs) with
IN / OUT and mlp_post's pieces at every layer, the tap op `vllm_lens::tap_inner` called as a compiled
forward calls it. Two figures:

- `launches_per_tap` / `programs_per_tap`: tap-kernel launches a call makes where the kernel runs (what a
  CUDA graph records at every mlp_post tap, and replays in every step, idle ones too), counted through a
  stand-in kernel object (load-independent);
- `idle_us`: host time of one call outside any step (a forward run outside CUDA graphs calls it from
  Python; on CPU engines every forward does), best and median of `--reps` batches of 20k calls.

Run it with PYTHONPATH on two trees to compare them (bench/results/2026-12-04-vm-points.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from vllm_worker.protocol import points
from vllm_worker.worker import graph, taps


class _CountingKernel:
    """Stands in for the Triton kernel: counts launches and programs (`kernel[grid](...)`)."""

    def __init__(self) -> None:
        self.launches = 0
        self.programs = 0

    def __getitem__(self, grid: tuple) -> object:
        def run(*args: object, **kwargs: object) -> None:
            self.launches += 1
            n = 1
            for g in grid:
                n *= int(g)
            self.programs += n

        return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--d-mlp", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    d, d_mlp, layers = a.d, a.d_mlp, a.layers
    chunks = points.mlp_chunks(d_mlp, d)
    sites: list[int] = []
    wide = {}
    for i in range(layers):
        pieces = points.mlp_piece_sites(i, chunks)
        sites += [points.site(i, points.IN), points.site(i, points.OUT), *pieces]
        wide[points.site(i, points.MLPPOST)] = [(s, j * d, min((j + 1) * d, d_mlp)) for j, s in enumerate(pieces)]
    g = graph.GraphTaps(sorted(sites), d, torch.float32, torch.device("cpu"), a.rows, None)
    kernel = _CountingKernel()
    g._kernel = kernel  # set before `wide`: one launch over the pieces needs a kernel
    g.wide = wide
    prev = taps.set_graph(g)
    op = torch.ops.vllm_lens.tap_inner
    x = torch.zeros(a.rows, d_mlp)
    tap_sites = list(wide)
    try:
        # where the kernel runs (as while a graph is recorded): every column live
        g._start(frozenset(range(g.n_cols)))
        for s in tap_sites:
            op(x, None, s)
        launches, programs = kernel.launches / len(tap_sites), kernel.programs / len(tap_sites)
        g.clear()  # idle: no step of this path running
        n = 20000
        per_call = []
        for _ in range(a.reps):
            t = time.perf_counter()
            for k in range(n):
                op(x, None, tap_sites[k % layers])
            per_call.append((time.perf_counter() - t) / n * 1e6)
    finally:
        taps.set_graph(prev)
    print(
        json.dumps(
            {
                "shape": {"d": d, "d_mlp": d_mlp, "pieces": chunks, "rows": a.rows},
                "launches_per_tap": launches,
                "programs_per_tap": programs,
                "idle_us": {"best": round(min(per_call), 2), "median": round(statistics.median(per_call), 2)},
            }
        )
    )


if __name__ == "__main__":
    main()
