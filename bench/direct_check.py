"""On a GPU: all-layer captures written straight into their result regions by the device
(`VLLM_LENS_DIRECT_COPY=1`) equal, byte for byte, the same batch copied by the early-assembly thread
(`=0`), and the direct path really ran (`direct_steps`). One in-process engine (the setting is read by the
worker when a batch is planned), compiled with CUDA graphs, the model given on the command line.

    python bench/direct_check.py MODEL [--n 64] [--new 32] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker reads this process's settings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    import torch
    from vllm import LLM, SamplingParams

    sys.path.insert(0, os.path.join(os.path.dirname(__file__)))
    from worker import prompts

    kw = dict(model=a.model, dtype=a.dtype, gpu_memory_utilization=float(os.environ.get("BENCH_GPU_UTIL", "0.3")))
    if os.environ.get("BENCH_LOAD_FORMAT"):
        kw["load_format"] = os.environ["BENCH_LOAD_FORMAT"]
    llm = LLM(**kw, max_model_len=a.prompt_len + a.new + 8)
    layers = list(range(llm.llm_engine.model_config.get_total_num_hidden_layers()))
    ps = [{"prompt_token_ids": p} for p in prompts(a.n, a.prompt_len)]
    sp = SamplingParams(
        max_tokens=a.new, temperature=0, ignore_eos=True, extra_args={"output_residual_stream": layers}
    )

    def status() -> dict:
        return dict(llm.collective_rpc("lens_status")[0]["fetch_timings"])

    report: dict = {}
    outs = {}
    for mode in ("1", "0", "1"):
        os.environ["VLLM_LENS_DIRECT_COPY"] = mode
        before = status()
        t = time.perf_counter()
        got = llm.generate(ps, sp, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        after = status()
        report[f"direct={mode}"] = {
            "wall_s": round(wall, 3),
            "direct_steps": after["direct_steps"] - before["direct_steps"],
            "thread_bytes": after["early_bytes"] - before["early_bytes"],
            "early_requests": after["early_requests"] - before["early_requests"],
        }
        outs[mode] = got
    same = all(
        torch.equal(x.activations["residual_stream"], y.activations["residual_stream"])
        and list(x.outputs[0].token_ids) == list(y.outputs[0].token_ids)
        for x, y in zip(outs["1"], outs["0"], strict=True)
    )
    acts = outs["1"][0].activations["residual_stream"]
    report["byte_equal"] = same
    report["shape"] = list(acts.shape)
    report["finite_nonzero"] = bool(acts.float().isfinite().all()) and float(acts.float().abs().sum()) > 0
    print("DIRECT_CHECK " + json.dumps(report))
    ok = same and report["finite_nonzero"] and report["direct=1"]["direct_steps"] > 0
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
