"""Frontend cost of one steering request on CPU: what vLLM's `SamplingParams.clone` (a deep copy of the
caller's `SteeringVector`) and our validation (`parse_request`) spend per request for W12 (ablate one
direction at all 32 layers, d = 4096) and W13 (cap at one layer), each in torch's thread pool (before) and in
one thread (as now), with digests of the validated rows (one value: the same rows).
Run: `python bench/probes/steer_frontend_cost.py [n]` (`STEER_REPEATS=5`: the least of 5 batches)."""

from __future__ import annotations

import copy
import hashlib
import os
import sys
import time

import torch
from pydantic import BaseModel

from vllm_worker.api.steering import SteeringVector
from vllm_worker.frontend.validation import parse_request
from vllm_worker.protocol.host_threads import one_thread
from vllm_worker.protocol.spec import ModelShape

D, LAYERS = 4096, 32
REPEATS = int(os.environ.get("STEER_REPEATS", "1"))  # batches per workload (the least time of each is printed)


def vector(workload: str, unit: torch.Tensor) -> SteeringVector:
    if workload == "W12":
        return SteeringVector(
            activations=unit.expand(LAYERS, D).clone(), layer_indices=list(range(LAYERS)), op="ablate"
        )
    return SteeringVector(activations=unit.view(1, D), layer_indices=[LAYERS // 2], op="cap", lo=-1.0, hi=1.0)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    shape = ModelShape(n_layers=LAYERS, d_model=D)
    g = torch.Generator().manual_seed(0)
    v = torch.randn(1, D, generator=g)
    unit = v / v.norm()
    for workload in ("W12", "W13"):
        vecs = [vector(workload, unit) for _ in range(n)]
        best: list[float] = []
        for _ in range(REPEATS):  # (each column: its least time over the repeats)
            t0 = time.perf_counter()
            pool_copies = [BaseModel.__deepcopy__(sv, {}) for sv in vecs]  # pydantic's own: torch's pool
            t1 = time.perf_counter()
            copies = [copy.deepcopy(sv) for sv in vecs]  # SteeringVector.__deepcopy__: one thread
            t2 = time.perf_counter()
            pool_specs = [parse_request({"apply_steering_vectors": [sv]}, shape, 30) for sv in pool_copies]
            t3 = time.perf_counter()
            with one_thread():  # as `on_new_request` runs it
                specs = [parse_request({"apply_steering_vectors": [sv]}, shape, 30) for sv in copies]
            t4 = time.perf_counter()
            ms = [(b - a) / n * 1e3 for a, b in ((t0, t1), (t1, t2), (t2, t3), (t3, t4))]
            best = ms if not best else [min(x, y) for x, y in zip(best, ms)]
        ms = best
        digests = {_digest(s.steers[0].vectors) for s in (pool_specs[0], specs[0], specs[-1])}
        print(
            f"{workload} ms/request: deepcopy {ms[0]:.3f} (pool) {ms[1]:.3f} (one thread); "
            f"validate {ms[2]:.3f} (pool) {ms[3]:.3f} (one thread); rows digests {sorted(digests)}"
        )


def _digest(rows: torch.Tensor) -> str:
    return hashlib.blake2b(rows.numpy().tobytes(), digest_size=8).hexdigest()


if __name__ == "__main__":
    main()
