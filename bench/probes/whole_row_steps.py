"""Which path a batch with whole-row edits at mlp_post takes, and its wall time on a CPU engine.

    PYTHONPATH=. .venv/bin/python bench/probes/whole_row_steps.py MODEL_DIR [--reps 3] [--new 16]

One engine (eager, float32, `VLLM_LENS_POINTS=mlp_post`); each round generates one batch: one request
ablating a direction and capping another at mlp_post of every layer, beside seven capture-only requests
(resid_post of the last layer), and one batch of the same eight without the edits. Prints per round the
steps each path ran (`counters.STEP_TIMINGS`: graph_steps vs python_steps) and the wall time of each batch.
Before wholerow the edited batch ran every step on the Python path; after, on the graph path (device
tables; CPU engines run the kernel's torch twin). On a GPU the difference is CUDA graphs (the Python path
runs eager); on this CPU it is only the host work of the two paths: the figure to read here is the steps.
Run it with PYTHONPATH on two trees to compare them (bench/results/2026-12-05-vm-wholerow.md).
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("VLLM_LENS_POINTS", "mlp_post")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # (the step counters live in this process)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new", type=int, default=16)
    args = ap.parse_args()

    import torch
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    from vllm_worker import SteeringVector
    from vllm_worker.counters import STEP_TIMINGS

    cfg = AutoConfig.from_pretrained(args.model)
    n_layers, d_mlp = cfg.num_hidden_layers, cfg.intermediate_size
    llm = LLM(args.model, dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    g = torch.Generator().manual_seed(0)
    u = torch.nn.functional.normalize(torch.randn(2, n_layers, d_mlp, generator=g), dim=-1)
    layers = list(range(n_layers))
    edits = [
        SteeringVector(u[0], layers, op="ablate", point="mlp_post"),
        SteeringVector(u[1], layers, op="cap", lo=-0.05, hi=0.05, point="mlp_post"),
    ]
    prompts = [
        f"The {w} of the river was long and" for w in ("water", "sound", "light", "edge", "end", "map", "day", "sea")
    ]
    base = dict(max_tokens=args.new, temperature=0, ignore_eos=True)
    cap = {"output_residual_stream": [n_layers - 1]}

    def batch(edited: bool) -> list:
        first = {**cap, "apply_steering_vectors": edits} if edited else cap
        return [SamplingParams(**base, extra_args=first)] + [SamplingParams(**base, extra_args=cap)] * 7

    for edited in (True, False):  # warm-up
        llm.generate(prompts, batch(edited), use_tqdm=False)
    for r in range(args.reps):
        row: dict = {"round": r}
        for edited in (True, False):
            before = dict(STEP_TIMINGS)
            t = time.perf_counter()
            llm.generate(prompts, batch(edited), use_tqdm=False)
            wall = time.perf_counter() - t
            tag = "edited" if edited else "plain"
            row[tag] = {
                "wall_s": round(wall, 3),
                **{k: STEP_TIMINGS[k] - before[k] for k in ("graph_steps", "python_steps")},
            }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
