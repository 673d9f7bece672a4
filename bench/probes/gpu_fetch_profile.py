"""ON THE LENT H200: where the time after the last decode step goes for large captures (issue 10).

One compiled engine (vLLM's default mode, multiprocess), the bench's 8B-shaped dummy model, 256 x 30 -> 128:
W0 (plugin installed, nothing requested) then W1 (capture the middle layer, all positions) three times and
W2 (all layers) once, printing per run: wall, the frontend's fetch/decode seconds, and the worker's fetch
break-down (waiting for transfers, prepared files late, allocation, copies) from `lens_status`.
Usage: VLLM_ALLOW_INSECURE_SERIALIZATION=1 PROFILE_RUNS=W0,W1:1,W1:8,W2:4 python3 bench/probes/gpu_fetch_profile.py MODEL
(`W1:4` = W1 with 4 assembly threads, set in the worker by a collective_rpc callable, hence the env)
-> one `PROFILE {...}` JSON line per run
"""

from __future__ import annotations

import json
import os
import sys
import time

from vllm import LLM, SamplingParams


def prompts(n: int, length: int) -> list[dict]:
    return [{"prompt_token_ids": [(1000 + 37 * i + 101 * j) % 30000 + 100 for j in range(length)]} for i in range(n)]


def _norm_item(ctx, h):  # W4: bench/worker.py's hook
    ctx.saved["norm"] = h.float().norm(dim=-1).mean().item() if h.numel() else 0.0


def _norm_on_device(ctx, h):  # W4n: the same, kept on the GPU
    ctx.saved["norm"] = h.float().norm(dim=-1).mean()


def _nothing(ctx, h):  # W4x: a hook that does nothing (our own cost per call)
    return None


def main() -> None:
    from vllm_worker import frontend

    model = sys.argv[1]
    runs = os.environ.get("PROFILE_RUNS", "W0,W1,W1,W1,W2").split(",")
    llm = LLM(
        model=model,
        load_format="dummy",
        dtype="bfloat16",
        seed=0,
        max_model_len=1024,
        gpu_memory_utilization=float(os.environ.get("BENCH_GPU_UTIL", "0.3")),
        max_num_seqs=256,
        enable_prefix_caching=False,
    )
    n_layers = llm.llm_engine.model_config.hf_config.num_hidden_layers
    ps = prompts(256, 30)

    def status() -> dict:
        return llm.collective_rpc("lens_status")[0]

    def extra(w: str):
        from vllm_worker import Hook

        return {
            "W0": None,
            "W1": {"output_residual_stream": [n_layers // 2]},
            "W2": {"output_residual_stream": list(range(n_layers))},
            "W4": {"apply_hooks": [Hook(fn=_norm_item, layer_indices=[n_layers // 2])]},
            "W4n": {"apply_hooks": [Hook(fn=_norm_on_device, layer_indices=[n_layers // 2])]},
            "W4x": {"apply_hooks": [Hook(fn=_nothing, layer_indices=[n_layers // 2])]},
        }[w]

    # warm-up (the first capture allocates pinned memory)
    llm.generate(
        ps[:64], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, extra_args=extra("W1")), use_tqdm=False
    )

    def set_threads(k: int) -> None:
        def f(_worker, k=k):
            import os

            from vllm_worker.worker import fetch

            # the thread cap is read when asked (envs), the per-thread size is a module constant
            os.environ["VLLM_LENS_ASSEMBLY_THREADS"] = str(k)
            fetch.ASSEMBLY_BYTES_PER_THREAD = 1

        llm.collective_rpc(f)

    for w in runs:
        threads = None
        if ":" in w:  # e.g. W1:4 = W1 with 4 assembly threads
            w, threads = w.split(":")
            set_threads(int(threads))
        before_f, before_s = dict(frontend.FRONTEND_TIMINGS), status()
        sp = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True, extra_args=extra(w))
        t = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        wall = time.perf_counter() - t
        after_s = status()
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        fetch = {
            k: round(after_s["fetch_timings"][k] - before_s["fetch_timings"].get(k, 0), 4)
            for k in after_s["fetch_timings"]
        }
        steps = {
            k: round(after_s["step_timings"][k] - before_s["step_timings"].get(k, 0), 4)
            for k in after_s["step_timings"]
        }
        steps.update(
            {
                k: round(after_s["hook_timings"][k] - before_s["hook_timings"].get(k, 0), 4)
                for k in after_s.get("hook_timings", {})
            }
        )
        pool_a, pool_b = after_s.get("result_pool") or {}, before_s.get("result_pool") or {}
        prep = {
            k: round(pool_a[k] - pool_b.get(k, 0), 4) if isinstance(pool_a[k], (int, float)) else pool_a[k]
            for k in pool_a
        }
        front = {k: round(frontend.FRONTEND_TIMINGS[k] - before_f[k], 4) for k in frontend.FRONTEND_TIMINGS}
        del outs
        print(
            "PROFILE "
            + json.dumps(
                {
                    "run": w,
                    "threads": threads,
                    "wall_s": round(wall, 3),
                    "tok_s": round(toks / wall),
                    "frontend": front,
                    "worker_fetch": fetch,
                    "steps": steps,
                    "result_pool": prep,
                    "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_LENS")},
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
