"""Early assembly on / off (`VLLM_LENS_EARLY_ASSEMBLY`), same engine, same run, interleaved repeats: a tiny
random Llama captures every layer of a batch of long prompts (a W2 in miniature) on CPU.

Per run: total wall of `LLM.generate`; "after last step": from the end of the last forward pass that filed
captures to `generate` returning with results (the fetch as the caller feels it: the worker's flush,
assembly and the frontend's handling); the worker's fetch (wait for copies + early flush + assembly) and
the early-assembly thread's bytes and seconds (`lens_status()["fetch_timings"]`). One in-process engine.

    python bench/probes/early_assembly.py [--requests 64] [--prompt 256] [--new 64] [--repeats 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_PLUGINS", "inspect_lens_worker")
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)

NAME = "bench-llama-tiny-early-v1"


def model_path() -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as `python bench/probes/early_assembly.py`
    from bench.make_model import random_llama

    return random_llama(
        NAME,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=16,
        num_attention_heads=8,
        num_key_value_heads=8,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=0, help="capture the middle K layers (0: all, a W2; 1: a W1)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_worker.worker import store as store_mod

    last_file = [0.0]
    orig_file = store_mod.CaptureStore.file_step

    def file_step(self, plan, host):  # bench only: when the last captures were filed
        orig_file(self, plan, host)
        last_file[0] = time.perf_counter()

    store_mod.CaptureStore.file_step = file_step

    llm = LLM(
        str(model_path()),
        dtype="float32",
        max_model_len=1024,
        seed=0,
        enforce_eager=True,
        kv_cache_memory_bytes=1 << 30,
        max_num_seqs=max(64, args.requests),
    )
    n_layers = llm.llm_engine.model_config.get_total_num_hidden_layers()
    k = args.layers or n_layers
    captured = list(range((n_layers - k) // 2, (n_layers - k) // 2 + k))
    L = len(captured)
    d = llm.llm_engine.model_config.get_hidden_size()
    prompts = [
        TokensPrompt(prompt_token_ids=[(i * 131 + j * 17) % 40000 + 100 for j in range(args.prompt)])
        for i in range(args.requests)
    ]
    sp = SamplingParams(
        max_tokens=args.new, temperature=0, ignore_eos=True, extra_args={"output_residual_stream": captured}
    )
    plain = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    n_pos = args.prompt + args.new - 1
    gb = args.requests * L * n_pos * d * 4 / 1e9

    def status() -> dict:
        return dict(llm.collective_rpc("lens_status")[0]["fetch_timings"])

    def run(mode: str) -> dict:
        import gc

        gc.collect()
        if mode == "plain":
            t0 = time.perf_counter()
            llm.generate(prompts, plain, use_tqdm=False)
            return {"wall_s": time.perf_counter() - t0}
        os.environ["VLLM_LENS_EARLY_ASSEMBLY"] = "1" if mode == "on" else "0"
        a = status()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        t1 = time.perf_counter()
        b = status()
        assert all(o.activations["residual_stream"].shape == (L, n_pos, d) for o in outs)
        del outs
        gc.collect()
        delta = {k: b[k] - a.get(k, 0) for k in b}
        return {
            "wall_s": t1 - t0,
            "after_last_step_s": t1 - last_file[0],
            "worker_fetch_s": delta["wait_copies_s"] + delta["early_flush_s"] + delta["assemble_s"],
            "early_flush_s": delta["early_flush_s"],
            "assemble_s": delta["assemble_s"],
            "fetch_copy_s": delta["copy_s"],
            "early_requests": delta["early_requests"],
            "early_fallbacks": delta["early_fallbacks"],
            "early_bytes_gb": delta["early_bytes"] / 1e9,
            "early_copy_s": delta["early_copy_s"],
            "early_index_s": delta["early_index_s"],
            "early_batches": delta["early_batches"],
        }

    for mode in ("plain", "off", "on"):  # warm-up (the pool grows to its size once)
        run(mode)
    rows: dict[str, list] = {"plain": [], "off": [], "on": []}
    order = ["plain", "off", "on"]
    for r in range(args.repeats):
        for mode in order[r % 3 :] + order[: r % 3]:
            rows[mode].append(run(mode))
            print(mode, json.dumps({k: round(v, 4) for k, v in rows[mode][-1].items()}), flush=True)
    med = {m: {k: statistics.median(x[k] for x in v) for k in v[0]} for m, v in rows.items()}
    report = {
        "machine": f"{os.cpu_count()} CPUs",
        "requests": args.requests,
        "prompt": args.prompt,
        "new": args.new,
        "layers": L,
        "d": d,
        "result_gb": gb,
        "repeats": args.repeats,
        "median": med,
        "runs": rows,
    }
    print(json.dumps(med, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
