"""The tail after the last forward of a probe workload, on CPU without an engine: the worker's fetch of every
request's probe scores (`fetch.assemble_all`: payloads as bytes) and the frontend's decoding of them onto
the finished outputs (`frontend.fetch._apply`, as `LLM.generate` does: scores by position and their
aggregates), reported apart. W10's shape by default: 256 requests x 8 probes (2 a site at 4 sites), a
30-token prompt's prefill then 128 decode steps (158 positions), the default aggregates mean, max, last over
the generated positions (`AGGREGATES` adds rolling_max:16 and ema:0.9). Best of `REPEATS` (5) passes.
Prints one JSON line. `RESULT_TAIL_THREADS=0`: torch's default thread count (as a frontend has), else that
many (default 1).

    python bench/probes/result_tail.py [requests] [probes] [more]   (probes 1: W9's shape; more 1: AGGREGATES)
"""

from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch
from filing_micro import D, empty_plan, probe_requests  # (bench/probes: beside this script)

from vllm_worker.frontend import fetch as frontend_fetch
from vllm_worker.frontend.state import Pending
from vllm_worker.worker import fetch, probes

PROMPT, STEPS, REPEATS = 30, int(os.environ.get("RESULT_TAIL_STEPS", "128")), 5
AGGREGATES = ["rolling_max:16", "ema:0.9"]


def _filed(n_req: int, n_probes: int) -> list[SimpleNamespace]:
    """Requests whose scores were filed as the engine does: one prefill composition (PROMPT rows each),
    then one decode composition (a row each) for STEPS steps. `RESULT_TAIL_CHUNKS=c` (> 1): admitted in c
    chunks as a real engine's token budget admits them, one composition per chunk (the requests admitted so
    far decoding, the chunk's prefilling), then all of them decoding: c + 1 spans a request, c groups."""
    g = torch.Generator().manual_seed(1)
    reqs, sites = probe_requests(n_req, n_probes, g)
    col = {s: i for i, s in enumerate(sites)}
    chunks = int(os.environ.get("RESULT_TAIL_CHUNKS", "1"))
    size = -(-n_req // chunks)
    steps_done = [0] * n_req  # decode steps filed per request
    if chunks > 1:
        comps = [(range(0, k * size), range(k * size, min((k + 1) * size, n_req)), 1) for k in range(chunks)]
        comps.append((range(n_req), range(0), STEPS - chunks + 1))
    else:
        comps = [(range(0), range(n_req), 1), (range(n_req), range(0), STEPS)]
    for decoding, prefilling, n_steps in comps:
        widths = [(r, 1) for r in decoding] + [(r, PROMPT) for r in prefilling]
        items, at = [], 0
        for r, w in widths:
            items.append((reqs[r], at, at + w))
            at += w
        gp = empty_plan(at)
        probes.stage_probes(
            gp, {s: list(items) for s in sites}, col, lambda it: np.concatenate([np.arange(a, b) for _, a, b in it])
        )
        total = gp.total = len(gp.cap_rows)
        for _ in range(n_steps):
            stage = torch.randn(total, D, generator=g)
            pos = np.concatenate(
                [np.array([PROMPT + steps_done[r]]) for r in decoding] + [np.arange(PROMPT) for _ in prefilling]
            ).astype(np.int64)
            probes.scores_from_stage(gp, stage, 0, pos)
            for r in decoding:
                steps_done[r] += 1
    return reqs


def _outputs(n_req: int, wanted: dict) -> list[tuple]:
    """`_apply`'s todo: finished outputs (one sample each) and their pending entries."""
    todo = []
    for i in range(n_req):
        c = SimpleNamespace(index=0, token_ids=[0] * STEPS)
        out = SimpleNamespace(request_id=f"r{i}", outputs=[c], prompt_token_ids=[0] * PROMPT)
        p = Pending(key=f"r{i}", n=1, layers=[], d_model=D, probes=wanted, prompt_len=PROMPT)
        todo.append((out, p, {0: c}, {0: PROMPT + STEPS - 1}))
    return todo


def main(n_req: int, n_probes: int, more: int = 0) -> dict:
    threads = int(os.environ.get("RESULT_TAIL_THREADS", "1"))
    if threads:
        torch.set_num_threads(threads)
    reqs = _filed(n_req, n_probes)
    todo = [(None, None, r.store, PROMPT + STEPS) for r in reqs]
    aggs = ["mean", "max", "last"] + (AGGREGATES if more else [])
    wanted = {f"m8_{j}": {"aggregate": aggs, "positions": "generated"} for j in range(n_probes)}
    worker, frontend = [], []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        got = fetch.assemble_all(todo, [], None, None)
        t1 = time.perf_counter()
        outs = _outputs(n_req, wanted)
        fetched = {f"r{i}": {0: [part]} for i, part in enumerate(got)}
        t2 = time.perf_counter()
        failures = frontend_fetch._apply(outs, fetched)
        t3 = time.perf_counter()
        assert not failures, failures
        worker.append(t1 - t0)
        frontend.append(t3 - t2)
    return {
        "requests": n_req,
        "probes": n_probes,
        "aggregates": aggs,
        "positions": PROMPT + STEPS,
        "worker_fetch_ms_per_request": round(1e3 * min(worker) / n_req, 3),
        "frontend_ms_per_request": round(1e3 * min(frontend) / n_req, 3),
        "tail_s": round(min(worker) + min(frontend), 4),
        "torch_threads": torch.get_num_threads(),
    }


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:4]]
    print(json.dumps(main(*(args + [256, 8, 0][len(args) :]))))
