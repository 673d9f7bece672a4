"""The frontend's cost of adding a batch to a real engine, per request, W0 against the steering workloads
(W11, W12, W12n, W13), on CPU with vLLM's multiprocess engine core (the H200 bench's `BENCH_MP=1`): the time
`LLM.generate` spends in `_render_and_add_requests` (vLLM's `process_inputs` with its params clone, our
`on_new_request`, the `EngineCoreRequest`'s msgpack encode and zmq send), i.e. how long the engine core
waits for the batch's last request. The model has the 8B shape where steering's bytes depend on it
(d_model 4096, 32 layers: W12's rows are 512 KB) and is tiny elsewhere (1 head of 32, MLP 32, vocab 512,
random weights), so the engine core's forwards stay short. Prints one line per workload and round: ms per
request added, and the difference from W0 in the same round. `--profile W12`: cProfile of that
workload's adding (the frontend process), top functions by own time.

    python bench/probes/add_cost.py [--rounds 3] [--requests 256] [--workloads W0,W12,W12n,W13] [--profile W]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # bench/: monitor_workloads

D, LAYERS, PROMPT, NEW = 4096, 32, 30, 2


def model_dir(root: str) -> str:
    """A Llama config of the 8B's width and depth, tiny elsewhere (weights: `load_format="dummy"`)."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": D,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "intermediate_size": 32,
        "vocab_size": 512,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "float32",
    }
    path = os.path.join(root, "model")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--workloads", default="W0,W12,W12n,W13")
    ap.add_argument("--profile", default="")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    import monitor_workloads
    import torch
    from vllm import LLM, SamplingParams

    from vllm_worker import SteeringVector

    root = tempfile.mkdtemp(prefix="lens-add-cost-")
    llm = LLM(
        model_dir(root), dtype="float32", load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
        max_model_len=64, max_num_seqs=a.requests, max_num_batched_tokens=max(2048, a.requests * PROMPT), seed=0,
    )  # fmt: skip
    vec = torch.randn(1, D, generator=torch.Generator().manual_seed(0))
    monitor_workloads.register_vectors(llm, vec)
    monitor_workloads.load_probes(llm, LAYERS, D)  # (W11's "m1")
    adds: list[float] = []
    orig = llm._render_and_add_requests

    prof: list = [None]  # the profiler of the batch being added, if any

    def timed(*args, **kwargs):  # (the adding alone: the engine core runs meanwhile, as on the H200)
        t = time.perf_counter()
        if prof[0] is not None:
            prof[0].enable()
        try:
            return orig(*args, **kwargs)
        finally:
            if prof[0] is not None:
                prof[0].disable()
            adds.append(time.perf_counter() - t)

    llm._render_and_add_requests = timed  # type: ignore[method-assign]
    prompts = [{"prompt_token_ids": [(i * 7 + j) % 500 + 3 for j in range(PROMPT)]} for i in range(a.requests)]
    workloads = a.workloads.split(",")

    def sps(w: str) -> list:
        ex = None if w == "W0" else monitor_workloads.extra(w, LAYERS, D, vec, SteeringVector)
        return [SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, extra_args=ex) for _ in prompts]

    for w in workloads:  # warm-up: every path once
        llm.generate(prompts[:4], sps(w)[:4], use_tqdm=False)
    print("round workload ms/request(add) minus_W0 wall_s")
    for r in range(a.rounds):
        base = None
        for w in workloads:
            params = sps(w)
            prof[0] = cProfile.Profile() if w == a.profile and r == a.rounds - 1 else None
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            assert len(outs) == len(prompts) and all(len(o.outputs[0].token_ids) == NEW for o in outs)
            ms = adds[-1] / len(prompts) * 1e3
            base = ms if w == "W0" else base
            diff = "" if base is None or w == "W0" else f"{ms - base:+.3f}"
            print(f"{r} {w} {ms:.3f} {diff} {wall:.2f}", flush=True)
            if prof[0] is not None:
                pstats.Stats(prof[0]).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
