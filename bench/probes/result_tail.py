"""The tail after the last forward of a probe workload, on CPU without an engine: the worker's fetch of every
request's probe scores (`fetch.assemble_all`: payloads as bytes) and the frontend's reading of them
(`probe_results.probe_outputs`: scores by position and their aggregates), per request. W10's shape by
default: 256 requests x 8 probes (2 a site at 4 sites), a 30-token prompt's prefill then 128 decode steps
(158 positions), aggregates mean, max, last over the generated positions. Prints one JSON line.

    python bench/probes/result_tail.py [requests] [probes]   (probes 1: W9's shape)
"""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch
from filing_micro import D, empty_plan, probe_requests  # (bench/probes: beside this script)

from vllm_worker.frontend.probe_results import probe_outputs
from vllm_worker.worker import fetch, probes

PROMPT, STEPS = 30, 128


def _filed(n_req: int, n_probes: int) -> list[SimpleNamespace]:
    """Requests whose scores were filed as the engine does: one prefill composition (PROMPT rows each),
    then one decode composition (a row each) for STEPS steps."""
    g = torch.Generator().manual_seed(1)
    reqs, sites = probe_requests(n_req, n_probes, g)
    col = {s: i for i, s in enumerate(sites)}
    for width in (PROMPT, 1):
        items = [(r, i * width, (i + 1) * width) for i, r in enumerate(reqs)]
        gp = empty_plan(n_req * width)
        probes.stage_probes(
            gp, {s: list(items) for s in sites}, col, lambda it: np.concatenate([np.arange(a, b) for _, a, b in it])
        )
        total = gp.total = len(gp.cap_rows)
        for k in range(1 if width > 1 else STEPS):
            stage = torch.randn(total, D, generator=g)
            pos = np.tile(np.arange(PROMPT), n_req) if width > 1 else np.full(n_req, PROMPT + k, dtype=np.int64)
            probes.scores_from_stage(gp, stage, 0, pos)
    return reqs


def main(n_req: int, n_probes: int) -> dict:
    torch.set_num_threads(1)
    reqs = _filed(n_req, n_probes)
    todo = [(None, None, r.store, PROMPT + STEPS) for r in reqs]
    t0 = time.perf_counter()
    got = fetch.assemble_all(todo, [], None, None)
    t1 = time.perf_counter()
    wanted = {f"m8_{j}": {"aggregate": ["mean", "max", "last"]} for j in range(n_probes)}
    for part in got:
        probe_outputs([part], wanted, PROMPT)
    t2 = time.perf_counter()
    return {
        "requests": n_req,
        "probes": n_probes,
        "positions": PROMPT + STEPS,
        "worker_fetch_ms_per_request": round(1e3 * (t1 - t0) / n_req, 3),
        "frontend_ms_per_request": round(1e3 * (t2 - t1) / n_req, 3),
        "tail_s": round(t2 - t0, 3),
    }


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    print(json.dumps(main(*(args + [256, 8][len(args) :]))))
