"""The worker's per-step host cost of filing probe scores and SAE features, alone: the graph-safe path's
after-step calls (`probes.scores_from_stage`, `saes.features_from_stage`) on a staged batch of decode rows,
step after step as one batch composition runs, then every request's fetch (`payload`: alone, and as one
fetch of them all sharing the records' host copies, `fetch.shared_records`) — on CPU tensors,
without an engine, so the figure is the Python and dispatch cost the H200 run saw grow with requests x
probes (bench/results/2026-12-04-h200-monitors.md §2), not compute; and the torch operations a steady step
dispatches (views not counted): each a launch on CUDA, the H200 host's main per-step cost there.

W10's shape by default: 256 requests x 8 probes (2 a site at 4 sites), 128 steps; SAE: one top-k (k=16)
feature output per request at one site. Prints one JSON line.

    python bench/probes/filing_micro.py [requests] [steps] [probes]   (probes 1: W9's shape, one site)
"""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_worker.protocol.wire import tensor_to_bytes
from vllm_worker.sae import Sae
from vllm_worker.worker import fetch, probes, saes
from vllm_worker.worker.request_results import RequestResults

D, LAYERS, D_SAE = 128, (2, 4, 6, 8), 512
STAGE_DTYPE = torch.bfloat16  # the ring's rows are the model's dtype (bf16 on the H200)


def empty_plan(n: int) -> SimpleNamespace:
    """What `probes.stage_probes` / `saes.stage_features` read of a graph plan of `n` batch rows."""
    e = np.zeros(0, dtype=np.int64)
    return SimpleNamespace(n=n, cap_rows=e, cap_cols=e, n_extra=0, probes={}, sae={})


def probe_requests(n_req: int, n_probes: int, g: torch.Generator) -> tuple[list[SimpleNamespace], list[int]]:
    """`n_req` requests scoring probes "m8_0" .. (two a site at LAYERS: W10's shape), loaded on a CPU worker;
    and their sites, sorted."""
    wp = probes.WorkerProbes(torch.device("cpu"), frozenset(range(16)))
    for j in range(n_probes):
        w = torch.randn(1, D, generator=g)
        wire = {"layers": [LAYERS[j // 2]], "point": "resid_post", "output": "logit", "weight": tensor_to_bytes(w)}
        wp.load(f"m8_{j}", f"u{j}", wire)
    uses = wp.uses([{"probe": f"m8_{j}", "uid": f"u{j}"} for j in range(n_probes)])
    sites = sorted({s for u in uses for s in u.weights})
    return [SimpleNamespace(probes=uses, sae=[], store=RequestResults([])) for _ in range(n_req)], sites


class _OpCount(TorchDispatchMode):
    """Counts the aten operations dispatched (a device launch each on CUDA, roughly: on the H200 host each
    costs tens of microseconds, bench/results/2026-12-04-h200-sync-probe.jsonl)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func not in _VIEWS:
            self.n += 1
        return func(*args, **(kwargs or {}))


# no kernel: views (and `.numpy()`'s detach)
_VIEWS = {getattr(torch.ops.aten, n).default for n in ("narrow", "view", "t", "alias", "permute", "detach")}
_VIEWS |= {torch.ops.aten.select.int, torch.ops.aten.slice.Tensor, torch.ops.aten.transpose.int}
OPS: dict[str, int] = {}  # ops of one (steady) step, by the function timed


def _time_steps(fn: object, gp: SimpleNamespace, steps: int, n: int) -> float:
    g = torch.Generator().manual_seed(0)
    total = gp.total = len(gp.cap_rows)  # (`plan.GraphPlan.total`)
    stage = torch.randn(2 * total, D, generator=g).to(STAGE_DTYPE)
    t = 0.0
    for k in range(steps):
        pos = np.arange(n, dtype=np.int64) + 24 + k
        if k == 4:  # (not a chunk's first step: chunks of 1, 2, 4 ... steps)
            with _OpCount() as c:
                fn(gp, stage, (k % 2) * total, pos)  # type: ignore[operator]
            OPS[getattr(fn, "__name__", "?")] = c.n
            continue
        t0 = time.perf_counter()
        fn(gp, stage, (k % 2) * total, pos)  # type: ignore[operator]
        t += time.perf_counter() - t0
    return t * steps / (steps - 1)


def main(n_req: int, steps: int, n_probes: int = 8) -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    reqs, sites = probe_requests(n_req, n_probes, g)
    items = [(r, i, i + 1) for i, r in enumerate(reqs)]
    col = {s: i for i, s in enumerate(sites)}
    gp = empty_plan(n_req)
    probes.stage_probes(gp, {s: list(items) for s in sites}, col, lambda it: np.array([s for _, s, _ in it]))
    file_s = _time_steps(probes.scores_from_stage, gp, steps, n_req)
    t0 = time.perf_counter()
    for r in reqs:
        probes.payload(r.store.probes)
    fetch_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    records = fetch.shared_records(n_req)  # one fetch of them all, as `fetch.assemble_all` does
    for r in reqs:
        probes.payload(r.store.probes, cache=records)
    fetch_shared_s = time.perf_counter() - t0

    sae = Sae("resid_post", 4, "standard", torch.randn(D, D_SAE, generator=g) / D**0.5, torch.zeros(D_SAE) - 0.1,
              torch.randn(D_SAE, D, generator=g) / D**0.5, torch.zeros(D))  # fmt: skip
    site = sites[0]
    sreqs = [
        SimpleNamespace(probes=[], sae=[saes.SaeUse("s", sae, site, 16)], store=RequestResults([]))
        for _ in range(n_req)
    ]
    sitems = [(r, i, i + 1) for i, r in enumerate(sreqs)]
    gp = empty_plan(n_req)
    saes.stage_features(gp, {}, {site: sitems}, col)
    sae_s = _time_steps(saes.features_from_stage, gp, steps, n_req)
    t0 = time.perf_counter()
    for r in sreqs:
        saes.payload(r.store.sae)
    sae_fetch_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    records = fetch.shared_records(n_req)
    for r in sreqs:
        saes.payload(r.store.sae, records)
    sae_fetch_shared_s = time.perf_counter() - t0
    return {
        "requests": n_req,
        "probes": n_probes,
        "sites": len(sites),
        "steps": steps,
        "probe_file_ms_per_step": round(1e3 * file_s / steps, 3),
        "probe_file_ops_per_step": OPS.get("scores_from_stage"),
        "probe_fetch_ms_per_request": round(1e3 * fetch_s / n_req, 3),
        "probe_fetch_shared_ms_per_request": round(1e3 * fetch_shared_s / n_req, 3),
        "sae_file_ms_per_step": round(1e3 * sae_s / steps, 3),
        "sae_file_ops_per_step": OPS.get("features_from_stage"),
        "sae_fetch_ms_per_request": round(1e3 * sae_fetch_s / n_req, 3),
        "sae_fetch_shared_ms_per_request": round(1e3 * sae_fetch_shared_s / n_req, 3),
    }


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:4]]
    print(json.dumps(main(*(args + [256, 128, 8][len(args) :]))))
