"""A step plan's host cost on CPU at the 8B shape (d 4096, 32 layers) for a batch of admitted requests: W12
(ablate at every layer), W12n-like repeats and W13 (cap at one layer), W11 (a gated steer), on the
graph-safe path (`make_plan` with the graph) and on the Python path (without it). A plan is made at every
change of the batch (5-6 a round on the H200; the first one lies before the first forward). Prints ms a
plan (least of `PLAN_REPEATS`) and Python calls a plan (load-independent), for the prefill (30 rows a
request) and a decode layout. Run: `python bench/probes/plan_cost.py [n_requests] [workloads]`."""

from __future__ import annotations

import os
import sys
import time

import torch

from bench.probes.admit_cost import LAYERS, D, admission, payload
from vllm_worker import compat
from vllm_worker.protocol.points import OUT, site
from vllm_worker.worker import graph
from vllm_worker.worker.actions import ActionTable
from vllm_worker.worker.plan import make_plan

REPEATS = int(os.environ.get("PLAN_REPEATS", "5"))


def calls_of(fn) -> int:  # type: ignore[no-untyped-def]
    got = [0]

    def count(frame, event, arg):  # type: ignore[no-untyped-def]
        if event in ("call", "c_call"):
            got[0] += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return got[0]


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    workloads = sys.argv[2].split(",") if len(sys.argv) > 2 else ["W11", "W12", "W13"]
    os.environ.setdefault("VLLM_LENS_STEER_MB", "64")
    torch.set_num_threads(1)
    unit = torch.nn.functional.normalize(torch.randn(D, generator=torch.Generator().manual_seed(0)), dim=0)
    compat.pp_last_stage()
    local = frozenset(site(l, OUT) for l in range(LAYERS))
    print("ms a plan (min) / Python calls a plan: graph prefill | graph decode | python prefill | python decode")
    for workload in workloads:
        g = graph.GraphTaps([site(l, OUT) for l in range(LAYERS)], D, torch.bfloat16, torch.device("cpu"), 256, None)
        actions = ActionTable(D, torch.device("cpu")) if workload == "W11" else None
        adm = admission(g, n, actions)
        states = [adm.admit(f"r{i}", payload(workload, i, unit)) for i in range(n)]
        adm.flush()
        cols = []
        for with_graph in (True, False):
            for rows in (30, 1):
                active = [(st, i * rows, (i + 1) * rows) for i, st in enumerate(states)]
                g.max_rows = max(g.max_rows, n * rows)  # (one plan of the whole batch, as on the H200)

                def one() -> object:
                    return make_plan(active, torch.device("cpu"), True, local, g if with_graph else None, n * rows)

                one()
                best = float("inf")
                for _ in range(REPEATS):
                    t = time.perf_counter()
                    one()
                    best = min(best, time.perf_counter() - t)
                cols.append(f"{best * 1e3:.2f} / {calls_of(one)}")
        print(f"{workload}: " + " | ".join(cols))


if __name__ == "__main__":
    main()
