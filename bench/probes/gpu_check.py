"""ON THE LENT H200: the graph-safe path against the Python path, in one engine (vLLM's default mode).

The same requests run twice: as they are (capture / steering only: the graph-safe kernel inside vLLM's
CUDA graphs) and with a no-op Python hook added to each (the step then runs without graphs and the taps
take the Python path). Captures at prompt positions must agree to bf16 rounding; plain batch-mates must
get the tokens they get alone. Prints one JSON line `CHECK {...}`. Usage: python3 bench/gpu_check.py MODEL
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch
from vllm import LLM, SamplingParams

from vllm_worker import Hook, SteeringVector


def noop(ctx, h):
    return None


def main() -> None:
    model = sys.argv[1]
    llm = LLM(
        model=model, load_format="dummy", dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=1024, seed=0
    )
    d = llm.llm_engine.model_config.get_hidden_size()
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 30000, size=30).tolist()} for _ in range(16)]
    g = torch.Generator().manual_seed(0)
    v2 = torch.randn(1, d, generator=g)
    v3 = torch.randn(1, 6, d, generator=g)
    extras = []
    for i in range(16):
        k = i % 4
        if k == 0:
            extras.append({"output_residual_stream": [16]})
        elif k == 1:
            extras.append(
                {
                    "output_residual_stream": [20],
                    "apply_steering_vectors": [SteeringVector(v2, [10], scale=4.0, norm_match=True)],
                }
            )
        elif k == 2:
            extras.append(
                {
                    "output_residual_stream": [20],
                    "apply_steering_vectors": [
                        SteeringVector(v3, [10], scale=2.0, norm_match=True, position_indices=list(range(6))),
                        SteeringVector(v2 * 0.05, [12]),
                    ],
                }
            )
        else:
            extras.append(None)

    def run(with_hook: bool, new: int = 16):
        sps = []
        for e in extras:
            e = dict(e or {})
            if with_hook:
                e["apply_hooks"] = [Hook(noop, [0])]
            sps.append(SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, extra_args=e or None))
        t = time.time()
        outs = llm.generate(prompts, sps, use_tqdm=False)
        return outs, time.time() - t

    run(False, 4)  # warm-up
    graph_outs, tg = run(False)
    py_outs, tp = run(True)
    alone, _ = (
        llm.generate(
            [prompts[i] for i in range(3, 16, 4)],
            SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
            use_tqdm=False,
        ),
        0,
    )
    res: dict = {"graph_s": round(tg, 3), "python_s": round(tp, 3), "cases": []}
    for i, (a, b) in enumerate(zip(graph_outs, py_outs)):
        case = {"i": i, "kind": i % 4, "tokens_equal": list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)}
        if a.activations is not None:
            x = a.activations["residual_stream"].float()[:, :30]
            y = b.activations["residual_stream"].float()[:, :30]
            case["shape"] = list(a.activations["residual_stream"].shape)
            case["prompt_rel_err"] = float((x - y).norm() / y.norm())
            case["max_abs"] = float((x - y).abs().max())
            case["norm"] = float(y.norm(dim=-1).mean())
        res["cases"].append(case)
    res["plain_mates_equal_alone"] = [
        list(graph_outs[i].outputs[0].token_ids) == list(o.outputs[0].token_ids) for i, o in zip(range(3, 16, 4), alone)
    ]
    res["status"] = llm.collective_rpc("lens_status")
    # steady state: 256 requests, capture one layer vs nothing (one call each, after a warm-up)
    big = [{"prompt_token_ids": rng.integers(100, 30000, size=30).tolist()} for _ in range(256)]
    for name, ex in (
        ("W0", None),
        ("W1", {"output_residual_stream": [16]}),
        ("W3", {"apply_steering_vectors": [SteeringVector(v2, [16], scale=4.0, norm_match=True)]}),
    ):
        sp = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True, extra_args=ex)
        llm.generate(
            big[:32], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, extra_args=ex), use_tqdm=False
        )
        from vllm_worker import frontend

        before = dict(frontend.FRONTEND_TIMINGS)
        t = time.time()
        llm.generate(big, sp, use_tqdm=False)
        res[f"{name}_tok_s"] = round(256 * 128 / (time.time() - t))
        res[f"{name}_wall_s"] = round(time.time() - t, 3)
        res[f"{name}_timings"] = {k: round(v - before.get(k, 0.0), 3) for k, v in frontend.FRONTEND_TIMINGS.items()}
    res["status_end"] = llm.collective_rpc("lens_status")
    print("CHECK " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
