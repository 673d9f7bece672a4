"""Does plain throughput decay after large captures? One engine, rounds of: plain batch, all-layer capture
batch(es), plain batch — the plain batches' tokens/s side by side, plus the process's RSS.

A GPU run once showed plain vLLM throughput at 0.69x in the round after all-layer captures (state or
memory left behind); this measures it directly in one process. Runs on CPU (the shipped SmolLM2, default)
or anywhere vLLM runs:

    .venv/bin/python bench/probes/decay.py [--model PATH] [--rounds 4] [--prompts 64] [--tokens 64] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the shipped SmolLM2-135M)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--captures-per-round", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--engine-args", default="{}", help="JSON of extra vllm.LLM arguments")
    args = ap.parse_args()

    import psutil
    from vllm import LLM, SamplingParams

    model = args.model
    if model is None:
        from vllm_worker.shipped_model import shipped_model_path

        model = str(shipped_model_path())
    extra = json.loads(args.engine_args)
    opts = dict(dtype="float32", max_model_len=1024, seed=0)
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE") is None and not extra:  # CPU default; on a GPU pass engine args
        opts["kv_cache_memory_bytes"] = 1 << 30
    opts.update(extra)
    llm = LLM(model, **opts)
    n_layers = llm.llm_engine.model_config.get_total_num_hidden_layers()
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 400 + 5 for j in range(32)]} for i in range(args.prompts)]
    plain = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    capture = SamplingParams(
        max_tokens=args.tokens,
        temperature=0,
        ignore_eos=True,
        extra_args={"output_residual_stream": list(range(n_layers))},
    )
    proc = psutil.Process()

    def tok_s(sp: SamplingParams) -> float:
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return args.prompts * args.tokens / (time.perf_counter() - t)

    tok_s(plain)  # warm-up
    tok_s(capture)
    rows = []
    for r in range(args.rounds):
        before = tok_s(plain)
        cap = [tok_s(capture) for _ in range(args.captures_per_round)]
        after = tok_s(plain)
        rows.append(
            {
                "round": r,
                "plain_before": before,
                "capture": cap,
                "plain_after": after,
                "after_over_before": after / before,
                "rss_mb": proc.memory_info().rss / 2**20,
            }
        )
        print(
            f"round {r}: plain {before:.0f} tok/s, all-layer capture {', '.join(f'{c:.0f}' for c in cap)}, "
            f"plain after {after:.0f} tok/s ({after / before:.3f}x), RSS {rows[-1]['rss_mb']:.0f} MB",
            flush=True,
        )
    first = rows[0]["plain_before"]
    last = rows[-1]["plain_after"]
    summary = {
        "model": model,
        "n_layers": n_layers,
        "prompts": args.prompts,
        "tokens": args.tokens,
        "rounds": rows,
        "last_after_over_first_before": last / first,
    }
    print(f"plain after {args.rounds} rounds of all-layer captures / plain before any: {last / first:.3f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
