"""W9 / W10's result tail on a real multiprocess engine (CPU): one fetch round trip against an overlapped
fetch (`VLLM_LENS_FETCH_OVERLAP`: round trips sent at once, each decoded while the engine core assembles the
next), interleaved round by round (1, N, 1, N ...) on one `LLM`. Per round: wall, the tail (the last forward
pass's end to `generate`'s return, on the worker's clock: `lens_forward_clock`, as bench/worker.py splits a
round), the frontend's fetch wait / decoding (`FRONTEND_TIMINGS`), the whole fetch-and-decode's wall and the
frontend thread's CPU time in it (wall - CPU: the frontend waiting, for the engine core or for a core on a busy
machine), the worker's assembly and the round trips;
every round's probe scores and aggregates are compared with the first round's of its workload (`torch.equal`,
dtype, shape). That check is only as strong as the engine is deterministic round to round (on CPU a batch's
prefill may be split differently); tests/unit/test_fetch_overlap.py is the exact one. Prints one JSON line per round, then a summary line.

    python bench/probes/tail_overlap.py MODEL [--rounds 8] [--requests 256] [--new 128] [--overlap 4]
        [--workloads W9,W10] [--dtype float32] [--load-format auto] [--kv-gb 0.25] [--graphs]
    (on the H200: --dtype bfloat16 --load-format dummy --graphs --kv-gb 8)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # bench/: monitor_workloads

PROMPT = 30


def _results(outs: list) -> list:
    return [(o.activations["probe_scores"], o.activations["probe_aggregates"]) for o in outs]


def _same(a: list, b: list) -> bool:
    """Every score tensor and aggregate of `a` equals `b`'s: bits, dtype, shape, names in order."""
    for (sa, ga), (sb, gb) in zip(a, b, strict=True):
        if list(sa) != list(sb) or list(ga) != list(gb):
            return False
        for name in sa:
            x, y = sa[name], sb[name]
            if x.dtype != y.dtype or x.shape != y.shape or not x.equal(y):
                return False
            if list(ga[name]) != list(gb[name]):
                return False
            for agg in ga[name]:
                x, y = ga[name][agg], gb[name][agg]
                if x.dtype != y.dtype or x.shape != y.shape or not x.equal(y):
                    return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--overlap", type=int, default=4)
    ap.add_argument("--workloads", default="W9,W10")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--load-format", default="auto")  # "dummy" for the H200's 8B-shaped .gpu/model
    ap.add_argument("--kv-gb", type=float, default=0.25)
    ap.add_argument("--graphs", action="store_true")  # vLLM's default compiled mode (else eager)
    a = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    import torch
    from monitor_workloads import extra, load_probes, probe_layers
    from vllm import LLM, SamplingParams

    from vllm_worker.counters import FETCH_OVERLAP, FRONTEND_TIMINGS
    from vllm_worker.frontend import fetch as frontend_fetch

    attach = {"wall_s": 0.0, "cpu_s": 0.0}
    orig = frontend_fetch._fetch_apply

    def timed(*args: object) -> object:  # the fetch and decoding of a generate: wall and this thread's CPU
        t, c = time.perf_counter(), time.thread_time()
        try:
            return orig(*args)  # type: ignore[arg-type]
        finally:
            attach["wall_s"] += time.perf_counter() - t
            attach["cpu_s"] += time.thread_time() - c

    frontend_fetch._fetch_apply = timed  # type: ignore[assignment]  # (attach_outputs looks it up at each call)

    llm = LLM(
        a.model,
        dtype=a.dtype,
        load_format=a.load_format,
        max_model_len=256,
        kv_cache_memory_bytes=int(a.kv_gb * (1 << 30)),
        seed=0,
        enforce_eager=not a.graphs,
    )
    cfg = llm.llm_engine.model_config.hf_config
    n_layers, d = cfg.num_hidden_layers, cfg.hidden_size
    if len(set(probe_layers(n_layers))) == 4:
        load_probes(llm, n_layers, d)
    else:  # a model too shallow for W10's spread: its first four layers (as gc_rounds.py)
        g = torch.Generator().manual_seed(1)
        llm.load_probe("m1", weight=torch.randn(1, d, generator=g), bias=torch.zeros(1), layers=[n_layers // 2])
        for j in range(8):
            w = torch.randn(1, d, generator=g)
            llm.load_probe(f"m8_{j}", weight=w, bias=torch.zeros(1), layers=[j // 2])
    prompts = [{"prompt_token_ids": [(7 * i + k) % 200 + 5 for k in range(PROMPT)]} for i in range(a.requests)]

    def params(w: str) -> SamplingParams:
        ex = extra(w, n_layers, d, torch.ones(1, d), None)
        return SamplingParams(max_tokens=a.new, ignore_eos=True, temperature=0, extra_args=ex)

    workloads = a.workloads.split(",")
    for w in workloads:  # warm-up (also answers the first fetch's host question), not recorded
        for overlap in (1, a.overlap):
            os.environ["VLLM_LENS_FETCH_OVERLAP"] = str(overlap)
            llm.generate(prompts, params(w), use_tqdm=False)
    gc.collect()
    gc.freeze()  # as the H200 bench does after warm-up (BENCH_GC_FREEZE=1)
    first: dict[str, list] = {}
    rows = []
    for r in range(a.rounds):
        for w in workloads:
            overlap = (1, a.overlap)[r % 2]
            os.environ["VLLM_LENS_FETCH_OVERLAP"] = str(overlap)
            t0, o0, x0 = dict(FRONTEND_TIMINGS), dict(FETCH_OVERLAP), dict(attach)
            a0 = llm.collective_rpc("lens_status")[0]["fetch_timings"]["assemble_s"]
            start = time.monotonic()
            outs = llm.generate(prompts, params(w), use_tqdm=False)
            end = time.monotonic()
            clock = [c for c in llm.collective_rpc("lens_forward_clock")[0] if start <= c[0] and c[1] <= end]
            a1 = llm.collective_rpc("lens_status")[0]["fetch_timings"]["assemble_s"]
            got = _results(outs)
            same = _same(first.setdefault(w, got), got)
            row = {
                "round": r,
                "workload": w,
                "overlap": overlap,
                "wall_s": round(end - start, 4),
                "tail_s": round(end - clock[-1][1], 4) if clock else None,
                "fetch_wait_s": round(FRONTEND_TIMINGS["fetch_rpc_s"] - t0["fetch_rpc_s"], 4),
                "decode_s": round(FRONTEND_TIMINGS["decode_s"] - t0["decode_s"], 4),
                "worker_assemble_s": round(a1 - a0, 4),
                "attach_wall_s": round(attach["wall_s"] - x0["wall_s"], 4),
                "attach_cpu_s": round(attach["cpu_s"] - x0["cpu_s"], 4),
                "round_trips": FETCH_OVERLAP["round_trips"] - o0["round_trips"] or 1,
                "same_bits_as_first": same,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            del outs, got
    summary = {}
    for w in workloads:
        for overlap in (1, a.overlap):
            mine = [x for x in rows if x["workload"] == w and x["overlap"] == overlap]
            for k in ("tail_s", "attach_wall_s", "attach_cpu_s", "fetch_wait_s", "worker_assemble_s"):
                v = [x[k] for x in mine]
                summary[f"{w}_overlap{overlap}_{k}"] = {"best": min(v), "median": round(statistics.median(v), 4)}
            idle = [x["attach_wall_s"] - x["attach_cpu_s"] for x in mine]  # the frontend not running: waiting
            summary[f"{w}_overlap{overlap}_attach_idle_s"] = {
                "best": round(min(idle), 4),
                "median": round(statistics.median(idle), 4),
            }
    summary["all_same_bits"] = all(x["same_bits_as_first"] for x in rows)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
