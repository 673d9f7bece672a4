"""The worker's host time per step spent after the forward (filing probe scores / SAE features, captures)
with every request scoring probes, on a small random Llama on CPU: the per-request Python that #42's H200
run found there (bench/results/2026-12-04-h200-monitors.md §2) shows as `after_s` per graph-safe step.

Workloads (`bench/monitor_workloads.py`): W0 nothing asked, W9 1 probe, W10 8 probes at 4 layers, and SAE a
top-k SAE feature output at one layer; 256 requests x 24 prompt tokens -> 32 new tokens, one batch, several
rounds in one engine (W0: one): a cost growing round after round shows here too, with what the workers hold
and the Python objects alive after each round. Prints one JSON line per round.

    python bench/probes/filing_cost.py [rounds] [new tokens]
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # counters of this process
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/probes/filing_cost.py`

N_REQ, PROMPT = 256, 24
SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2)
VOCAB = 512  # no tokenizer (token ids in, ids out): the step's own cost, not a 49k-word head's


def tiny_model() -> Path:
    """A random Llama of SHAPE, written once to the cache; its folder."""
    from vllm_worker.shipped_model import cache_root

    dst = cache_root() / "bench-llama-tiny-filing-v2"
    if not (dst / "config.json").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=512, torch_dtype="float32", **SHAPE)
        LlamaForCausalLM(cfg).save_pretrained(dst, safe_serialization=True)
    return dst


GC_S = [0.0, 0.0, 0.0]  # seconds in garbage collections this round, per generation
_gc_t0 = [0.0]


def _gc_clock(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_t0[0] = time.perf_counter()
    else:
        GC_S[info["generation"]] += time.perf_counter() - _gc_t0[0]


def main(rounds: int, new: int) -> None:
    gc.callbacks.append(_gc_clock)
    import torch
    from monitor_workloads import extra, load_probes
    from vllm import LLM, SamplingParams

    from vllm_worker import counters
    from vllm_worker.sae import Sae, save

    model = tiny_model()
    n_layers, d = SHAPE["num_hidden_layers"], SHAPE["hidden_size"]
    llm = LLM(
        str(model),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=N_REQ,
        max_num_batched_tokens=N_REQ * PROMPT,
        kv_cache_memory_bytes=1 << 30,
        enforce_eager=True,
        seed=0,
        skip_tokenizer_init=True,
    )
    load_probes(llm, n_layers, d)
    g = torch.Generator().manual_seed(3)
    w_enc, w_dec = torch.randn(d, 512, generator=g) / d**0.5, torch.randn(512, d, generator=g) / d**0.5
    sae = Sae("resid_post", n_layers // 2, "standard", w_enc, torch.zeros(512) - 0.1, w_dec, torch.zeros(d))
    with tempfile.TemporaryDirectory() as tmp:
        save(sae, Path(tmp) / "fsae")
        llm.load_sae("fsae", str(Path(tmp) / "fsae"))
    ids = torch.randint(1, VOCAB, (N_REQ, PROMPT), generator=g).tolist()
    prompts = [{"prompt_token_ids": p} for p in ids]
    for w in ("W0", "W9", "W10", "SAE"):
        if w == "W0":
            xa = None
        elif w == "SAE":
            xa = {"output_sae_features": {"sae": "fsae", "top_k": 16}}
        else:
            xa = extra(w, n_layers, d, torch.randn(1, d, generator=g), None)
        sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, detokenize=False, extra_args=xa)
        for r in range(1 if w == "W0" else rounds):
            st0, ft0 = dict(counters.STEP_TIMINGS), dict(counters.FETCH_TIMINGS)
            GC_S[:] = [0.0, 0.0, 0.0]
            t = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - t
            st = {k: counters.STEP_TIMINGS[k] - st0.get(k, 0) for k in counters.STEP_TIMINGS}
            ft = {k: counters.FETCH_TIMINGS[k] - ft0.get(k, 0) for k in counters.FETCH_TIMINGS}
            steps = st.get("graph_steps", 0) + st.get("python_steps", 0)
            status = llm.collective_rpc("lens_status")[0]
            gc.collect()
            line = {
                "workload": w,
                "round": r,
                "wall_s": round(wall, 3),
                "steps": steps,
                "graph_steps": st.get("graph_steps", 0),
                "after_ms_per_step": round(1e3 * st.get("after_s", 0) / max(st.get("graph_steps", 0), 1), 3),
                "plan_s": round(st.get("plan_s", 0), 3),
                "admit_s": round(st.get("admit_s", 0), 3),
                "forward_s": round(st.get("forward_s", 0), 3),
                "fetch_assemble_s": round(ft.get("assemble_s", 0), 3),
                "gc_s_by_generation": [round(x, 3) for x in GC_S],
                "objects": len(gc.get_objects()),  # (not counting those vLLM froze after start-up)
                "held": {
                    k: status[k] for k in ("stored_requests", "request_states", "probe_score_chunks", "stored_bytes")
                },
            }
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3, int(sys.argv[2]) if len(sys.argv) > 2 else 32)
