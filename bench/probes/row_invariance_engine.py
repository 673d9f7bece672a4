"""A request's probe scores across batch compositions on a real engine: 256 requests (prompts of 3 to 40 words)
with 8 probes (2 a layer at 4 layers, W10's shape), generated three times — twice in order, once reversed (so
every request has other neighbours in every step) — and the first 16 one at a time (alone: decode steps of one
row), on vLLM's multiprocess engine by default, where admission timing also varies from run to run. Counts the
requests whose scores (`torch.equal`) and tokens differ from the first run's. Prints one JSON line.

    python bench/probes/row_invariance_engine.py MODEL_DIR [--inproc] [--requests 256] [--tokens 16] [--alone 16]
"""

from __future__ import annotations

import argparse
import json
import os
import random

ORDERS = ("forward", "forward", "reversed", "alone")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--inproc", action="store_true")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--alone", type=int, default=16)
    a = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if a.inproc else "1"
    import torch
    import vllm
    from transformers import AutoConfig

    d = AutoConfig.from_pretrained(a.model).hidden_size
    llm = vllm.LLM(a.model, dtype="float32", max_model_len=512, seed=0, enforce_eager=True,
                   kv_cache_memory_bytes=256 << 20)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    names = []
    for j in range(8):
        names.append(f"rinv{j}")
        llm.load_probe(names[-1], weight=torch.randn(1, d, generator=g) / d**0.5, layers=[j // 2])
    words = "the water of people will come down to the side a long thing to see him how many did she".split()
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 40))) for _ in range(a.requests)]
    sp = vllm.SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True,
                             extra_args={"output_probe_scores": names})  # fmt: skip
    runs = []
    for order in ORDERS[:-1]:
        idx = list(range(a.requests))[:: -1 if order == "reversed" else 1]
        outs = llm.generate([prompts[i] for i in idx], [sp] * a.requests, use_tqdm=False)
        by = {i: o for i, o in zip(idx, outs)}
        runs.append([by[i] for i in range(a.requests)])
    # the first `--alone` requests one at a time (decode steps of one row)
    runs.append([llm.generate([prompts[i]], [sp], use_tqdm=False)[0] for i in range(a.alone)])
    first = runs[0]
    import vllm_worker

    report: dict = {"vllm": vllm.__version__, "multiprocess": not a.inproc, "requests": a.requests, "d": d}
    report["lens"] = os.path.dirname(os.path.dirname(vllm_worker.__file__))
    for k, run in enumerate(runs[1:], 1):
        tokens = sum(list(x.outputs[0].token_ids) != list(y.outputs[0].token_ids) for x, y in zip(first, run))
        differ, worst = 0, 0.0
        for x, y in zip(first, run):
            sx, sy = x.activations["probe_scores"], y.activations["probe_scores"]
            bad = [n for n in names if not torch.equal(sx[n], sy[n])]
            if bad:
                differ += 1
                worst = max(worst, max(float((sx[n] - sy[n]).abs().max()) for n in bad if sx[n].shape == sy[n].shape))
        report[f"run{k}"] = {"order": ORDERS[k], "requests": len(run), "tokens_differ": tokens,
                             "scores_differ": differ, "max_abs_diff": worst}  # fmt: skip
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
