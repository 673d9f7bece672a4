"""Admission cost of steering on the graph-safe path, on CPU: W12's request (ablate one direction at every
layer of an 8B-shaped model: d = 4096, 32 layers) and W13's (cap at one layer), admitted through the
worker's `Admission` (payload decode, entries, the step's flush) into a table like the H200 run's. Prints
ms per request and the table's entries in use. Run: `python bench/probes/admit_cost.py [n_requests]`."""

from __future__ import annotations

import os
import sys
import time

import torch

from vllm_worker.protocol.ops import ABLATE, CAP
from vllm_worker.protocol.points import OUT, site
from vllm_worker.protocol.spec import RequestSpec, Steer, encode
from vllm_worker.worker import graph
from vllm_worker.worker.admission import Admission
from vllm_worker.worker.store import CaptureStore

D, LAYERS = 4096, 32


def payload(workload: str, i: int, unit: torch.Tensor) -> dict:
    if workload == "W12":
        st = Steer([site(l, OUT) for l in range(LAYERS)], unit.expand(LAYERS, D).clone(), None, 1.0, False, op=ABLATE)
    else:
        st = Steer([site(LAYERS // 2, OUT)], unit.view(1, D).clone(), None, 1.0, False, op=CAP, lo=-1.0, hi=1.0)
    return encode(RequestSpec(key=f"k{i}", steers=[st]))


def admission(g: graph.GraphTaps) -> Admission:
    """The worker's admission with what a steering-only request touches (no hooks, SAEs, probes, actions)."""
    sites = frozenset(site(l, OUT) for l in range(LAYERS))
    store = CaptureStore(torch.device("cpu"))
    args = (None, torch.device("cpu"), torch.bfloat16, D, sites, frozenset(range(LAYERS)), {}, True, None, store)
    return Admission(*args, g, None, None)  # type: ignore[arg-type]


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    os.environ.setdefault("VLLM_LENS_STEER_MB", "64")
    unit = torch.nn.functional.normalize(torch.randn(D, generator=torch.Generator().manual_seed(0)), dim=0)
    for workload in ("W12", "W13"):
        g = graph.GraphTaps([site(l, OUT) for l in range(LAYERS)], D, torch.bfloat16, torch.device("cpu"), 256, None)
        adm = admission(g)
        msgs = [payload(workload, i, unit) for i in range(n)]
        t0 = time.perf_counter()
        states = [adm.admit(f"r{i}", m) for i, m in enumerate(msgs)]
        t1 = time.perf_counter()
        adm.flush()
        t2 = time.perf_counter()
        on_graph = sum(s.entries is not None for s in states)
        print(
            f"{workload}: {n} requests, admit {1e3 * (t1 - t0) / n:.2f} ms/request, flush {1e3 * (t2 - t1):.1f} ms, "
            f"entries in use {g.entries.in_use()} of {g.A.shape[0]}, graph-safe requests {on_graph}"
        )
        for s in states:
            g.free_entries(s.entry_ids)
        print(f"  after all left: entries in use {g.entries.in_use()}")


if __name__ == "__main__":
    main()
