"""What a monitor workload adds to a steady decode step, device and host, in a real in-process engine (GPU,
CUDA graphs): per workload, one warm round, then one round under torch's profiler (CUDA kernels by name, their
device µs summed over the round; kernels replayed inside CUDA graphs included where CUPTI reports them) and
one round with cProfile over the steady steps only (an unchanged batch: no request joined or left), whose
functions with the most own time are printed, any module's. Each workload is printed beside W0 (nothing
asked): the kernels it adds or lengthens, in µs a step, and the steady steps' median `execute_model` ms.

    python bench/probes/step_kernels.py MODEL [--device cpu] [--workloads W0,W9,W10,W12] [--new 64] [--top 25]
        [--out F.json]

W0 runs first whatever the list says; the bench gives the ratios, this says which kernels and functions make
the difference on the host that runs it.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import statistics
import time
from typing import Any

from step_host import bench_engine, run_round  # (bench/probes: beside this script; sets up the paths)


def kernels(prof: Any) -> dict[str, float]:
    """{kernel name: device µs} of a profiled round (CUDA kernels and memcpy / memset, not runtime calls)."""
    out: collections.Counter = collections.Counter()
    for e in prof.events():
        if getattr(e, "device_type", None) is None or str(e.device_type) != "DeviceType.CUDA":
            continue
        out[e.name[:90]] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda", help="cpu: the CPU engine, cProfile only (a smoke run)")
    ap.add_argument("--workloads", default="W0,W9,W10,W12")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    llm, extra, prompts = bench_engine(a.model, a.device, a.n)
    gpu = a.device != "cpu"
    exe = GPUModelRunner.execute_model
    state: dict[str, Any] = {"cp": None, "steady": []}

    def execute_model(runner: Any, so: Any, *args: Any, **kw: Any) -> Any:
        steady = not so.scheduled_new_reqs and not so.finished_req_ids and so.total_num_scheduled_tokens == a.n
        cp = state["cp"] if steady else None
        t = time.perf_counter()
        if cp is not None:
            cp.enable()
        try:
            return exe(runner, so, *args, **kw)
        finally:
            if cp is not None:
                cp.disable()
            if steady:
                state["steady"].append((time.perf_counter() - t) * 1e3)

    GPUModelRunner.execute_model = execute_model
    names = ["W0"] + [w for w in a.workloads.split(",") if w != "W0"]
    report: dict[str, Any] = {}
    base: dict[str, float] = {}
    for w in names:
        sp = [SamplingParams(max_tokens=a.new, temperature=0, ignore_eos=True, extra_args=extra(w)) for _ in prompts]
        run_round(llm, prompts, sp, 1, f"{w}-warm")
        state["steady"] = []
        k: dict[str, float] = {}
        if gpu:
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run_round(llm, prompts, sp, 1, f"{w}-prof")
                torch.cuda.synchronize()
            k = kernels(prof)
        steps = max(len(state["steady"]), 1)
        state["steady"], state["cp"] = [], cProfile.Profile()
        run_round(llm, prompts, sp, 1, f"{w}-cprof")
        cp, state["cp"] = state["cp"], None
        plain_ms = statistics.median(state["steady"]) if state["steady"] else float("nan")
        if not gpu:
            steps = max(len(state["steady"]), 1)
        s = io.StringIO()
        pstats.Stats(cp, stream=s).sort_stats("tottime").print_stats(a.top)
        ours = io.StringIO()
        pstats.Stats(cp, stream=ours).sort_stats("tottime").print_stats("vllm_worker", a.top)
        per_step = {n: round(us / steps, 2) for n, us in k.items()}
        if w == "W0":
            base = per_step
        diff = {n: round(v - base.get(n, 0.0), 2) for n, v in per_step.items() if abs(v - base.get(n, 0.0)) >= 1}
        report[w] = {
            "steady_steps": steps,
            "device_us_per_step": round(sum(per_step.values()), 1),
            "device_us_per_step_vs_w0": round(sum(per_step.values()) - sum(base.values()), 1),
            "kernels_vs_w0_us_per_step": dict(sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:20]),
            "steady_execute_ms_median_cprofiled": round(plain_ms, 3),
        }
        print(f"== {w}: {json.dumps(report[w])}", flush=True)
        lines = s.getvalue().splitlines()
        start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
        print("\n".join(line[:160] for line in lines[start : start + a.top + 1]), flush=True)
        print("  of them vllm_worker's:", flush=True)
        print("\n".join(line[:160] for line in ours.getvalue().splitlines() if "vllm_worker" in line), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
