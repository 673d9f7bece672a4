"""The frontend's garbage collections round by round on a real engine (CPU): W0 and W10 (8 probes, 2 a layer
at 4 layers, every request) in turn on one `LLM`, per round its wall, the frontend's fetch RPC and decoding
(`FRONTEND_TIMINGS`), and the collections per generation with their seconds (`gc.callbacks`), with the
process's tracked objects. `--freeze`: `gc.freeze()` after the warm-up rounds, as vLLM's own servers and
`vllm bench serve` do for their processes (a harness's choice for every system alike; the library never
does it in a caller's process). `--mp`: vLLM's multiprocess engine (the H200 bench's `BENCH_MP=1`), else
in-process. Prints one JSON line per round.

    python bench/probes/gc_rounds.py MODEL [--mp] [--freeze] [--rounds 8] [--requests 256] [--new 32]
        [--dtype float32] [--load-format auto] [--kv-gb 0.25] [--eager]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # bench/: monitor_workloads

PROMPT = 30


class Collections:
    """Collections per generation and their seconds since the last `take` (`gc.callbacks`)."""

    def __init__(self) -> None:
        self.n, self.s, self._t = [0, 0, 0], [0.0, 0.0, 0.0], 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.n[info["generation"]] += 1
            self.s[info["generation"]] += time.perf_counter() - self._t

    def take(self) -> dict:
        out = {"collections": self.n, "gc_s": [round(x, 4) for x in self.s]}
        self.n, self.s = [0, 0, 0], [0.0, 0.0, 0.0]
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--mp", action="store_true")
    ap.add_argument("--freeze", action="store_true")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--load-format", default="auto")  # "dummy" for the H200's 8B-shaped .gpu/model
    ap.add_argument("--kv-gb", type=float, default=0.25)
    ap.add_argument("--eager", action="store_true")  # (the CPU runs of 2026-12-04-vm-tailgc.md)
    a = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if a.mp else "0"
    import torch
    from monitor_workloads import extra, load_probes, probe_layers
    from vllm import LLM, SamplingParams

    from vllm_worker.counters import FRONTEND_TIMINGS

    kv = int(a.kv_gb * (1 << 30))
    llm = LLM(
        a.model,
        dtype=a.dtype,
        load_format=a.load_format,
        max_model_len=256,
        kv_cache_memory_bytes=kv,
        seed=0,
        enforce_eager=a.eager,
    )
    cfg = llm.llm_engine.model_config.hf_config
    if len(set(probe_layers(cfg.num_hidden_layers))) == 4:
        load_probes(llm, cfg.num_hidden_layers, cfg.hidden_size)
    else:  # a model too shallow for W10's spread: its first four layers
        g = torch.Generator().manual_seed(1)
        for j in range(8):
            w = torch.randn(1, cfg.hidden_size, generator=g)
            llm.load_probe(f"m8_{j}", weight=w, bias=torch.zeros(1), layers=[j // 2])
    prompts = [{"prompt_token_ids": [(7 * i + k) % 200 + 5 for k in range(PROMPT)]} for i in range(a.requests)]

    def params(w: str) -> SamplingParams:
        ex = extra(w, cfg.num_hidden_layers, cfg.hidden_size, torch.ones(1), None) if w == "W10" else {}
        return SamplingParams(max_tokens=a.new, min_tokens=a.new, temperature=0, extra_args=ex or None)

    for w in ("W0", "W10"):  # warm-up, not recorded
        llm.generate(prompts[:8], params(w), use_tqdm=False)
    if a.freeze:
        gc.collect()
        gc.freeze()
    clock = Collections()
    held = None
    for r in range(a.rounds):
        w = ("W0", "W10")[r % 2]
        t0 = dict(FRONTEND_TIMINGS)
        tracked = len(gc.get_objects())
        clock.take()
        t = time.perf_counter()
        outs = llm.generate(prompts, params(w), use_tqdm=False)
        wall = time.perf_counter() - t
        if w == "W10":
            assert all(len(o.activations["probe_scores"]) == 8 for o in outs)
        held = outs  # a harness holds a run's outputs while it checks them
        row = {"round": r, "workload": w, "wall_s": round(wall, 3), "tracked": tracked, "frozen": gc.get_freeze_count()}
        row.update({k: round(FRONTEND_TIMINGS[k] - t0[k], 4) for k in FRONTEND_TIMINGS})
        row.update(clock.take())
        print(json.dumps(row), flush=True)
    del held


if __name__ == "__main__":
    main()
