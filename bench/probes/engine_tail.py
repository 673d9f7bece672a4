"""The result tail of W9 / W10 on a real engine (CPU): per round the worker's assembly (`fetch_timings`
`assemble_s`, read over `lens_status`), the frontend's fetch round trip and decoding (`FRONTEND_TIMINGS`),
and the generate call's wall; W0 / W9 / W10 in turn on one `LLM` (the shipped SmolLM2 by default: W10's
probes at layers 9, 13, 17, 21). The heap is frozen after warm-up, as the bench does. `--profile W10`:
cProfile of the frontend's `_fetch` (in-process: the worker's assembly runs in it) and `_apply` of that
workload's rounds, the top functions printed to stderr. `--save F`: the last round of each probe workload's
`probe_scores` / `probe_aggregates` (`torch.save`), to compare two trees bitwise (`--compare F G`).
Prints one JSON line per round.

    python bench/probes/engine_tail.py [--model M] [--mp] [--rounds 6] [--requests 256] [--new 32]
        [--workloads W0,W9,W10] [--profile W10] [--save F]
    python bench/probes/engine_tail.py --compare A.pt B.pt
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # bench/: monitor_workloads

PROMPT = 30


def compare(a: str, b: str) -> None:
    """Every probe score and aggregate of two `--save` files: torch.equal (NaN where the other is NaN)."""
    import torch

    x, y = torch.load(a), torch.load(b)
    assert x.keys() == y.keys(), (x.keys(), y.keys())
    n = 0
    for w in x:
        assert len(x[w]) == len(y[w]), w
        for sa, sb in zip(x[w], y[w]):
            pairs = [(sa["scores"][k], sb["scores"][k], k) for k in sa["scores"]]
            pairs += [(sa["aggs"][k][g], sb["aggs"][k][g], f"{k}.{g}") for k in sa["aggs"] for g in sa["aggs"][k]]
            assert sa["scores"].keys() == sb["scores"].keys() and sa["aggs"].keys() == sb["aggs"].keys()
            for t1, t2, what in pairs:
                assert t1.dtype == t2.dtype and t1.shape == t2.shape, (w, what)
                assert torch.equal(t1.isnan(), t2.isnan()), (w, what)
                assert torch.equal(t1.nan_to_num(123.0), t2.nan_to_num(123.0)), (w, what)
                n += 1
    print(json.dumps({"equal_tensors": n}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--mp", action="store_true")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--workloads", default="W0,W9,W10")
    ap.add_argument("--profile", default="")
    ap.add_argument("--save", default="")
    ap.add_argument("--profile-out", default="")
    ap.add_argument("--compare", nargs=2, default=None)
    a = ap.parse_args()
    if a.compare:
        compare(*a.compare)
        return
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if a.mp else "0"
    import torch
    from monitor_workloads import extra, load_probes
    from vllm import LLM, SamplingParams

    from vllm_worker.counters import FRONTEND_TIMINGS
    from vllm_worker.frontend import fetch as ffetch
    from vllm_worker.shipped_model import shipped_model_path

    llm = LLM(
        a.model or str(shipped_model_path()),
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=1 << 30,
        seed=0,
        enforce_eager=True,
    )
    cfg = llm.llm_engine.model_config.hf_config
    load_probes(llm, cfg.num_hidden_layers, cfg.hidden_size)
    prompts = [{"prompt_token_ids": [(7 * i + k) % 200 + 5 for k in range(PROMPT)]} for i in range(a.requests)]

    def params(w: str) -> SamplingParams:
        ex = extra(w, cfg.num_hidden_layers, cfg.hidden_size, torch.ones(1, cfg.hidden_size), None) if w != "W0" else {}
        return SamplingParams(max_tokens=a.new, min_tokens=a.new, temperature=0, ignore_eos=True, extra_args=ex or None)

    prof = cProfile.Profile()
    if a.profile:
        on = {"yes": False}

        def profiled(orig):  # type: ignore[no-untyped-def]
            def call(*args):  # type: ignore[no-untyped-def]
                if not on["yes"]:
                    return orig(*args)
                prof.enable()
                try:
                    return orig(*args)
                finally:
                    prof.disable()

            return call

        ffetch._fetch, ffetch._apply = profiled(ffetch._fetch), profiled(ffetch._apply)

    works = a.workloads.split(",")
    for w in works:  # warm-up, not recorded
        llm.generate(prompts[:8], params(w), use_tqdm=False)
    gc.collect()
    gc.freeze()

    def fetch_timings() -> dict:
        return dict(llm.collective_rpc("lens_status")[0]["fetch_timings"])

    saved: dict = {}
    last_f = fetch_timings()
    for r in range(a.rounds):
        for w in works:
            t0 = dict(FRONTEND_TIMINGS)
            if a.profile:
                on["yes"] = w == a.profile
            t = time.perf_counter()
            outs = llm.generate(prompts, params(w), use_tqdm=False)
            wall = time.perf_counter() - t
            on_ = a.profile and w == a.profile
            if on_:
                on["yes"] = False
            f = fetch_timings()
            row = {"round": r, "workload": w, "wall_s": round(wall, 4)}
            row.update({k: round((FRONTEND_TIMINGS[k] - t0[k]) * 1e3, 2) for k in FRONTEND_TIMINGS})
            row["assemble_ms"] = round((f["assemble_s"] - last_f["assemble_s"]) * 1e3, 2)
            last_f = fetch_timings()
            print(json.dumps(row), flush=True)
            if w != "W0":
                n = len(outs[0].activations["probe_scores"])
                assert all(len(o.activations["probe_scores"]) == n for o in outs)
                if a.save and r == a.rounds - 1:
                    saved[w] = [
                        {"scores": o.activations["probe_scores"], "aggs": o.activations["probe_aggregates"]}
                        for o in outs
                    ]
            del outs
    if a.save:
        torch.save(saved, a.save)
    if a.profile:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        if a.profile_out:
            prof.dump_stats(a.profile_out)
        print(s.getvalue(), file=sys.stderr)


if __name__ == "__main__":
    main()
