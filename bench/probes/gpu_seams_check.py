"""ON THE LENT H200: Python hooks inside full CUDA graphs cut at the taps (`vllm_worker.worker.seams`),
against the same requests on the Python path (`VLLM_LENS_SEAMS=0`, no full graphs), in one in-process
engine in vLLM's default mode.

A batch of 16 mixes: a hook that edits the stream (x 1.5 at layer 8) with captures before and after it,
a batched hook reading norms at layer 16 (two requests), steering, a capture, and plain requests.
Both runs must give the same tokens, the same hook readings and captures (bf16 rounding), and the cut
graphs must have replayed (`status()["seams"]["replays"]`). Prints one JSON line `SEAMS {...}`.
Usage: python3 bench/gpu_seams_check.py MODEL
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # runtime env switches reach the worker

import numpy as np
import torch
from vllm import LLM, SamplingParams

from vllm_worker import Hook, SteeringVector


def scale(ctx, h):
    ctx.saved["calls"] = ctx.saved.get("calls", 0) + 1
    return h * 1.5


def norms(ctx, h):
    n = h.float().norm(dim=-1)
    for rid, s, e in ctx.rows:
        ctx.saved[rid].setdefault("norm", []).append(n[s:e])
    return None


def main() -> None:
    out: dict = {}
    llm = LLM(
        model=sys.argv[1], load_format="dummy", dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=1024, seed=0
    )
    status = lambda: llm.collective_rpc("lens_status")[0]  # noqa: E731
    out["after_start"] = status()["seams"]
    d = llm.llm_engine.model_config.get_hidden_size()
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 30000, size=30).tolist()} for _ in range(16)]
    v = torch.randn(1, d, generator=torch.Generator().manual_seed(0))
    extras: list = []
    for i in range(16):
        k = i % 8
        if k == 0:
            extras.append({"apply_hooks": [Hook(scale, [8])], "output_residual_stream": [4, 12]})
        elif k in (1, 2):
            extras.append({"apply_hooks": [Hook(norms, [16], batched=True)]})
        elif k == 3:
            extras.append(
                {
                    "apply_steering_vectors": [SteeringVector(v, [10], scale=4.0, norm_match=True)],
                    "output_residual_stream": [20],
                }
            )
        elif k == 4:
            extras.append({"output_residual_stream": [16]})
        else:
            extras.append(None)
    sps = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, extra_args=e) for e in extras]

    def run(on: bool):
        os.environ["VLLM_LENS_SEAMS"] = "1" if on else "0"
        before = status()
        res = llm.generate(prompts, sps, use_tqdm=False)
        after = status()
        steps = {
            k: after["step_timings"][k] - before["step_timings"][k]
            for k in ("graph_steps", "seam_steps", "python_steps")
        }
        seam = {k: after["seams"][k] - before["seams"][k] for k in ("replays", "eager_fallbacks")}
        return res, steps, seam

    try:
        run(True)  # warm-up
        a, out["seams_steps"], out["seams_stats"] = run(True)
        b, out["python_steps"], out["python_stats"] = run(False)
        out["tokens_equal"] = [list(x.outputs[0].token_ids) == list(y.outputs[0].token_ids) for x, y in zip(a, b)]
        rel = []
        for x, y in zip(a, b):
            if x.activations is not None:
                p, q = (
                    x.activations["residual_stream"].float()[:, :30],
                    y.activations["residual_stream"].float()[:, :30],
                )
                rel.append(float((p - q).abs().max() / q.abs().max()))
        out["capture_max_rel_diff"] = rel
        hr = []
        for i in (1, 2, 9, 10):
            p = torch.cat([t.float().cpu().reshape(-1) for t in a[i].hook_results["0"]["norm"][:3]])
            q = torch.cat([t.float().cpu().reshape(-1) for t in b[i].hook_results["0"]["norm"][:3]])
            hr.append(float((p - q).abs().max() / q.abs().max()))
        out["hook_reading_max_rel_diff"] = hr
        out["scale_calls"] = [a[0].hook_results["0"]["calls"], b[0].hook_results["0"]["calls"]]
        # the edit at layer 8 reached the capture at 12 and not the one at 4 (against the request without it)
        plain = llm.generate(
            prompts[:1], SamplingParams(max_tokens=1, extra_args={"output_residual_stream": [4, 12]}), use_tqdm=False
        )[0]
        pa, pp = (
            a[0].activations["residual_stream"].float()[:, :30],
            plain.activations["residual_stream"].float()[:, :30],
        )
        out["edit_seen"] = {
            "layer4_rel": float((pa[0] - pp[0]).abs().max() / pp[0].abs().max()),
            "layer12_rel": float((pa[1] - pp[1]).abs().max() / pp[1].abs().max()),
        }
        os.environ["VLLM_LENS_SEAMS"] = "1"
    except Exception:  # noqa: BLE001
        out["error"] = traceback.format_exc()
    out["final"] = status()["seams"]
    print("SEAMS " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
