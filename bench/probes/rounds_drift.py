"""Round-over-round drift on CPU: the same workload run round after round in one engine (in-process, so the
worker's state can be read between rounds). Per round: the wall, the step counters' deltas, `lens_status`
counts, and what the worker and frontend hold (request states, steering entries, shared vectors, stores,
the control table's memo, Python objects alive, the garbage collector's collections). Anything that grows
round after round while the work is the same is the drift's suspect.

Run: `python bench/probes/rounds_drift.py [MODEL_DIR or -] [workloads: W0,W9,W12,W13] [rounds] [requests]`
(default: the tests' tiny llama; several workloads run in that order each round, as the benchmark does)."""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # 1: the engine core in its own process, as served

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

from vllm_worker import SteeringVector  # noqa: E402
from vllm_worker.counters import FRONTEND_TIMINGS  # noqa: E402

LAST: dict = {}  # the worker's step counters after the last round
GC_STATS: list[float] = []  # seconds in each gen-2 collection


def _gc_timer(phase: str, info: dict) -> None:
    if info.get("generation") != 2:
        return
    if phase == "start":
        GC_STATS.append(-time.perf_counter())
    else:
        GC_STATS[-1] += time.perf_counter()


def sizes(prefix: str, obj: object) -> dict:
    """The length of every container attribute of `obj` (what could grow round after round)."""
    out = {}
    for k, v in vars(obj).items():
        if isinstance(v, (dict, list, set, tuple)) or type(v).__name__ in ("deque", "WeakValueDictionary"):
            out[f"{prefix}.{k}"] = len(v)  # type: ignore[arg-type]
    return out


def worker_view(worker) -> dict:
    rt = worker._lens_rt()
    g = rt.graph
    out = {}
    for name in ("store", "admission", "graph", "probes", "actions", "saes", "persistent", "python"):
        part = getattr(rt, name, None)
        if part is not None and hasattr(part, "__dict__"):
            out |= sizes(name, part)
    if g is not None:
        out |= sizes("table", g.table) | sizes("entries", g.entries) | sizes("ring", g.ring)
    out |= {
        "reqs": len(rt._reqs),
        "stores": len(rt.store._stores),
        "evicted": len(rt.store._evicted),
        "on_device": len(getattr(rt.admission, "_on_device", {})),
    }
    if g is not None:
        out |= {
            "entries": g.entries.in_use(),
            "free_top": g.entries._free[-1] if g.entries._free else -1,
            "col_index": len(g.table._col_index),
            "chains": len(getattr(g.entries, "_chains", {})),
        }
    return out


def main() -> None:
    tiny = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "inspect-lens/test-models-v1/tiny-llama"
    model = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "-" else str(tiny)
    workloads = (sys.argv[2] if len(sys.argv) > 2 else "W13").split(",")
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    llm = LLM(model, dtype="float32", max_model_len=256, kv_cache_memory_bytes=256 << 20, seed=0)
    cfg = llm.llm_engine.model_config.hf_config
    d, n_layers = cfg.hidden_size, cfg.num_hidden_layers
    unit = torch.nn.functional.normalize(torch.randn(1, d, generator=torch.Generator().manual_seed(0)), dim=-1)
    mid = n_layers // 2
    llm.load_probe("m1", weight=torch.randn(1, d), bias=torch.zeros(1), layers=[mid])
    extras = {
        "W0": {},
        "W9": {"output_probe_scores": ["m1"]},
        "W12": {
            "apply_steering_vectors": [
                SteeringVector(unit.expand(n_layers, d).clone(), list(range(n_layers)), op="ablate")
            ]
        },
        "W13": {"apply_steering_vectors": [SteeringVector(unit, [mid], op="cap", lo=-1.0, hi=1.0)]},
    }
    prompts = [f"the water of people number {i} will come down to the side" for i in range(n)]
    gc.callbacks.append(_gc_timer)
    for r in range(rounds):
        for workload in workloads:
            run_round(llm, r, workload, prompts, extras[workload])


def run_round(llm: LLM, r: int, workload: str, prompts: list[str], extra: dict) -> None:
    sps = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=16, extra_args=dict(extra)) for _ in prompts]
    front = dict(FRONTEND_TIMINGS)
    g0 = len(GC_STATS)
    t = time.perf_counter()
    llm.generate(prompts, sps, use_tqdm=False)
    wall = time.perf_counter() - t
    keys = ("graph_steps", "python_steps", "admit_s", "plan_s", "after_s", "forward_s")
    status = llm.collective_rpc("lens_status")[0]
    worker = {k: v for k, v in status["step_timings"].items() if k in keys}  # (cumulative, in the worker)
    delta = {k: round(v - LAST.get(k, 0), 3) for k, v in worker.items()}
    LAST.update(worker)
    delta |= {k: round(FRONTEND_TIMINGS[k] - front[k], 3) for k in FRONTEND_TIMINGS}
    counts = {k: status.get(k) for k in ("request_states", "steering_entries", "stored_requests")}
    try:  # (a function as RPC: the in-process engine; a separate engine core may refuse it)
        view = llm.collective_rpc(worker_view)[0]
    except Exception as e:  # noqa: BLE001 - diagnostics only
        view = {"worker_view": type(e).__name__}
    from vllm_worker.frontend.state import engine_state

    view |= sizes("frontend", engine_state(llm))
    gcs = GC_STATS[g0:]
    print(
        f"round {r} {workload}: wall {wall:.3f} s  {delta}  {counts}  worker {view}  "
        f"objects {len(gc.get_objects())}  gen2 gc {len(gcs)} x {sum(gcs):.3f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
