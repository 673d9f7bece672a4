"""ON THE LENT GPU: with vLLM's batch-invariant mode on (`VLLM_BATCH_INVARIANT=1`), is a request's probe output
the same bits alone and among 256 others? One in-process `LLM` (the worker in this process: the script reads
what it read, `compat.batch_invariant_mode()` and `projection`'s switch); 16 tracked requests (30-token
prompts) with probe scores (one output at one layer, three at the next, a probe over both layers), their
residual at both layers (is vLLM's own activation invariant: a score can only be as invariant as its rows),
4 of them steered (an add), 4 with two probe actions (an inline direction fired at the first prompt position,
one at generated token 8 (NEW // 2 if less) steering from there: `value` is `rowdot`'s score there). Run A: the 16 alone;
B: the same 16 spread among 256 others (prompts of 3..200 tokens: prefill chunks beside decode rows; the
others name another probe at the same sites, so the stacked columns differ too; a third of them run an action
too); C: each of the 16 one at a time. Per check (scores per probe, residual, tokens, action outcomes;
B and C against A) one JSON line: how many requests differ (bitwise) and by how much. Exits 0 on a
difference too (the JSON says it).

    python3 bench/probes/gpu_batch_invariant.py MODEL    # the 8B-shaped dummy folder (.gpu/model), bf16

CPU smoke test of the script (the mode is GPU-only: its kernels are Triton, and on CPU it replaces CPU ops with
kernels that cannot run there, so the script says so and checks the plain CPU path, which is invariant):
    BI_DEVICE=cpu BI_DTYPE=float32 BI_DUMMY=0 BI_OTHERS=24 BI_NEW=6 python bench/probes/gpu_batch_invariant.py DIR
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process: read what it read
DEVICE = os.environ.get("BI_DEVICE", "cuda")
if DEVICE == "cuda":
    os.environ["VLLM_BATCH_INVARIANT"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

PROMPT, TRACKED = 30, 16
NEW = int(os.environ.get("BI_NEW", "16"))
OTHERS = int(os.environ.get("BI_OTHERS", "256"))


def emit(**kw: Any) -> None:
    print(json.dumps(kw, default=str), flush=True)


def diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    """0.0 when bitwise equal, the largest absolute difference otherwise (inf: shapes differ, None missing)."""
    if a is None or b is None:
        return None if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    return 0.0 if torch.equal(a, b) else float((a.float() - b.float()).abs().max())


def main() -> None:
    from vllm import LLM, SamplingParams

    from vllm_worker import SteeringVector, compat
    from vllm_worker.worker import projection

    t_all = time.time()
    model = sys.argv[1]
    kw: dict[str, Any] = dict(model=model, dtype=os.environ.get("BI_DTYPE", "bfloat16"), max_model_len=1024, seed=0)
    kw["enable_prefix_caching"] = False
    if os.environ.get("BI_DUMMY", "1") == "1":
        kw["load_format"] = "dummy"
    if DEVICE == "cuda":
        kw["gpu_memory_utilization"] = float(os.environ.get("BI_GPU_UTIL", "0.3"))
    else:
        kw["kv_cache_memory_bytes"] = 512 << 20
    t0 = time.time()
    llm = LLM(**kw)
    startup = time.time() - t0
    cfg = llm.llm_engine.model_config.hf_config
    n_layers, d = cfg.num_hidden_layers, cfg.hidden_size
    mid = n_layers // 2
    emit(
        check="engine",
        device=DEVICE,
        gpu=torch.cuda.get_device_name() if DEVICE == "cuda" else None,
        vllm=compat.vllm_version(),
        mode_requested=os.environ.get("VLLM_BATCH_INVARIANT") == "1",
        mode_supported=DEVICE == "cuda",
        why=None if DEVICE == "cuda" else "GPU only: the mode's kernels are Triton; on CPU the plain path runs",
        mode_on=compat.batch_invariant_mode(),
        worker_projection_mode=projection._BATCH_INVARIANT,
        model=model,
        dtype=kw["dtype"],
        startup_s=round(startup, 1),
    )
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    llm.load_probe("p1", weight=rand(1, d, scale=d**-0.5), bias=rand(1), layers=[mid], point="resid_post")
    llm.load_probe("p3", weight=rand(3, d, scale=d**-0.5), layers=[mid + 1], point="resid_post")
    llm.load_probe("pm", weight=rand(2, 2 * d, scale=d**-0.5), layers=[mid, mid + 1], point="resid_post")
    llm.load_probe("px", weight=rand(4, d, scale=d**-0.5), layers=[mid], point="resid_post")  # the others'
    steer = [SteeringVector(rand(1, d, scale=4.0), [mid - 1])]
    actions = [
        {"direction": rand(d, scale=d**-0.5).tolist(), "layer": mid, "name": "first", "threshold": -1e30,
         "positions": [0], "then": {"steer": SteeringVector(rand(1, d), [mid + 2])}},
        {"probe": "p1", "threshold": -1e30, "positions": [PROMPT - 1 + min(8, NEW // 2)],
         "then": {"steer": SteeringVector(rand(1, d, scale=4.0), [mid + 2])}},
    ]  # fmt: skip
    rng = np.random.default_rng(0)
    tracked = [rng.integers(100, 20000, size=PROMPT).tolist() for _ in range(TRACKED)]
    others = [rng.integers(100, 20000, size=int(rng.integers(3, 200))).tolist() for _ in range(OTHERS)]

    def extra(i: int) -> dict:
        e: dict[str, Any] = {"output_probe_scores": ["p1", "p3", "pm"], "output_residual_stream": [mid, mid + 1]}
        if i < 4:
            e["apply_steering_vectors"] = steer
        elif i < 8:
            e["probe_actions"] = actions
        return e

    def other(j: int) -> dict | None:
        if j % 3 == 0:
            return None
        if j % 3 == 1:
            return {"output_probe_scores": ["p1", "px"]}
        return {
            "output_probe_scores": ["px", "p3"],
            "probe_actions": [{"probe": "px", "output": 2, "threshold": 1e30, "then": "stop"}],
        }

    def sp(e: dict | None) -> SamplingParams:
        return SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, extra_args=e)

    def run(batch: list[tuple[list[int], dict | None]]) -> list[Any]:
        return llm.generate([{"prompt_token_ids": p} for p, _ in batch], [sp(e) for _, e in batch], use_tqdm=False)

    t0 = time.time()
    a = run([(tracked[i], extra(i)) for i in range(TRACKED)])
    mixed: list[tuple[list[int], dict | None]] = [(p, other(j)) for j, p in enumerate(others)]
    at = [min(len(mixed), k * max(1, len(mixed) // TRACKED) + 3) for k in range(TRACKED)]
    for k in reversed(range(TRACKED)):
        mixed.insert(at[k], (tracked[k], extra(k)))
    outs = run(mixed)
    where = [at[k] + k for k in range(TRACKED)]
    b = [outs[w] for w in where]
    assert all(list(o.prompt_token_ids) == tracked[k] for k, o in enumerate(b))
    c = [run([(tracked[i], extra(i))])[0] for i in range(TRACKED)]
    gen_s = time.time() - t0
    summary: dict[str, Any] = {}
    for tag, got in (("among_others", b), ("one_at_a_time", c)):
        res_eq = []
        for x, y in zip(a, got):
            rx, ry = x.activations["residual_stream"], y.activations["residual_stream"]
            res_eq.append([diff(rx[k], ry[k]) == 0.0 for k in range(2)])
        rdiffs = [diff(x.activations["residual_stream"], y.activations["residual_stream"]) for x, y in zip(a, got)]
        emit(check="residual", run=tag, layers=[mid, mid + 1], **_count(rdiffs))
        for name, layers in (("p1", [0]), ("p3", [1]), ("pm", [0, 1])):
            ds = [
                diff(x.activations["probe_scores"][name], y.activations["probe_scores"][name]) for x, y in zip(a, got)
            ]
            where_rows_equal = [dd for dd, eq in zip(ds, res_eq) if all(eq[k] for k in layers)]
            emit(check="scores", probe=name, run=tag, **_count(ds), rows_equal=len(where_rows_equal),
                 differ_where_rows_equal=sum(dd != 0.0 for dd in where_rows_equal))  # fmt: skip
            summary[f"{tag}:{name}"] = _count(ds)["differ"]
        for kind, ks in (("plain", range(8, TRACKED)), ("steered", range(4)), ("actions", range(4, 8))):
            n = sum(list(a[k].outputs[0].token_ids) != list(got[k].outputs[0].token_ids) for k in ks)
            emit(check="tokens", kind=kind, run=tag, requests=len(ks), differ=n)
            summary[f"{tag}:tokens_{kind}"] = n
        acts = [(a[k].activations.get("probe_actions"), got[k].activations.get("probe_actions")) for k in range(4, 8)]
        bad = [k for k, (x, y) in zip(range(4, 8), acts) if x != y]
        vals = [[o.get("value") for o in (x or [])] for x, _ in acts]
        emit(check="actions", run=tag, requests=4, differ=len(bad), first=acts[0][0], values=vals)
        summary[f"{tag}:actions"] = len(bad)
    emit(check="summary", all_equal=not any(summary.values()), differ=summary, generate_s=round(gen_s, 1),
         wall_s=round(time.time() - t_all, 1))  # fmt: skip


def _count(ds: list[float | None]) -> dict[str, Any]:
    bad = [dd for dd in ds if dd != 0.0]
    worst = max((dd for dd in bad if dd is not None), default=0.0)
    return {"requests": len(ds), "differ": len(bad), "max_abs_diff": worst}


if __name__ == "__main__":
    main()
