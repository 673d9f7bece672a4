"""ON THE LENT H200: direct writes (`VLLM_LENS_DIRECT_POOL=1`: the GPU writes each step's captured rows into
their shared-memory result regions) give the same bytes as host copies.

One engine (vLLM's default mode, CUDA graphs) started with direct mode on. The same all-layer batch runs three
times: the first grows the result pool (its regions are taken by the copy thread: host copies), the next two
find registered pool memory and are written by the GPU. Every result must equal the first run's byte for byte,
and the counters must show which path served each run. Prints one JSON line `CHECK {...}`.
Usage: VLLM_LENS_DIRECT_POOL=1 python3 bench/gpu_direct_check.py MODEL
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch
from vllm import LLM, SamplingParams


def main() -> None:
    model = sys.argv[1]
    assert os.environ.get("VLLM_LENS_DIRECT_POOL") == "1"
    llm = LLM(
        model=model, load_format="dummy", dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=1024, seed=0
    )
    L = llm.llm_engine.model_config.get_total_num_hidden_layers()
    rng = np.random.default_rng(0)
    n = 64
    prompts = [
        {"prompt_token_ids": rng.integers(100, 30000, size=int(rng.integers(20, 60))).tolist()} for _ in range(n)
    ]
    sps = [
        SamplingParams(
            max_tokens=int(m), temperature=0, ignore_eos=True, extra_args={"output_residual_stream": list(range(L))}
        )
        for m in rng.integers(8, 40, size=n)
    ]

    def timings() -> dict:
        return dict(llm.collective_rpc("lens_status")[0]["fetch_timings"])

    runs = []
    outs = []
    for i in range(3):
        t0 = timings()
        w = time.perf_counter()
        got = llm.generate(prompts, sps, use_tqdm=False)
        wall = time.perf_counter() - w
        t1 = timings()
        keys = (
            "direct_regions",
            "direct_steps",
            "direct_only_steps",
            "direct_rows",
            "early_requests",
            "early_bytes",
            "early_fallbacks",
            "arena_alloc_s",
        )
        runs.append({"run": i, "wall_s": round(wall, 3), **{k: t1[k] - t0[k] for k in keys}})
        outs.append(got)
        if i == 0:
            time.sleep(3)  # let the pool finish growing and registering
    same = []
    for i in (1, 2):
        ok = True
        for a, b in zip(outs[0], outs[i], strict=True):
            ok &= list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
            x, y = a.activations["residual_stream"], b.activations["residual_stream"]
            ok &= x.shape == y.shape and bool(torch.equal(x.view(torch.int16), y.view(torch.int16)))
        same.append(ok)
    pool = llm.collective_rpc("lens_status")[0].get("result_pool") or {}
    direct_used = runs[2]["direct_steps"] > 0
    result = {
        "runs": runs,
        "equal_to_host_copies": same,
        "pool": {k: pool.get(k) for k in ("segments", "bytes", "pinned_segments", "pin_s", "direct_allocs")},
        "ok": all(same) and direct_used,
    }
    print("CHECK " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
