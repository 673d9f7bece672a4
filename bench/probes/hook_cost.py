"""What one Python hook call costs us on the host: a CPU micro-benchmark on one in-process engine.

    PYTHONPATH=. .venv/bin/python bench/probes/hook_cost.py [--n 256] [--new 16] [--reps 3] [--workloads W4n,W4b]

A tiny random Llama (the tests' `tiny-llama`, d_model 128: the device work is negligible, so what is
measured is host time) serves `--n` requests of 8-token prompts, `--new` new tokens each, eagerly, with
VLLM_ENABLE_V1_MULTIPROCESSING=0. Per workload (bench/worker.py's hook functions, on the middle layer):

- W0: no hook (the baseline);
- W4n: `ctx.saved["norm"] = h.float().norm(dim=-1).mean()` as a per-request hook (one call per request per step);
- W4b: the same reading as one batched hook (`_norm_hook_batched`: one call per step for every request).

Reported per hook call (a batched call counts once): `step_wall_us` (the extra wall time of the decode
steps over W0's, from runs of `--new` and twice as many tokens: request-level costs cancel out),
`ours_us` and `in_fn_us` (counters.HOOK_TIMINGS: host time around the hook function inside the taps — slicing,
the stream sum, the context, checks — and inside it), and from cProfile (a separate run) `py_calls`: Python
function calls in vllm_worker per hook call beyond W0's (load-independent; includes per-request work:
admission, planning, results), `ops` every call (torch ops,
builtins) made from edits.py per hook call, and where the time under `edits.run_hooks` goes.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench"), str(ROOT)]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from support.engines import make_engine  # noqa: E402  (sets the engine environment before vLLM loads)


def _params(workload: str, mid: int, new: int):
    from vllm import SamplingParams
    from worker import _norm_hook_batched, _norm_hook_on_device

    from vllm_worker import Hook

    extra = None
    if workload == "W4n":
        extra = {"apply_hooks": [Hook(_norm_hook_on_device, [mid])]}
    elif workload == "W4b":
        extra = {"apply_hooks": [Hook(_norm_hook_batched, [mid], batched=True)]}
    elif workload != "W0":
        raise ValueError(workload)
    return SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, extra_args=extra)


def _run(llm, prompts, sp, workload):
    outs = llm.generate(prompts, sp, use_tqdm=False)
    if workload != "W0":  # the hook really ran, for every request
        import torch

        for o in outs:
            assert bool(torch.isfinite(torch.as_tensor(o.hook_results["0"]["norm"]))), o.hook_results
    return outs


EDITS = os.path.join("worker", "edits.py")


def _is_ours(filename: str) -> bool:
    return f"{os.sep}vllm_worker{os.sep}" in filename


def _profile(llm, prompts, sp, workload) -> pstats.Stats:
    prof = cProfile.Profile()
    prof.enable()
    _run(llm, prompts, sp, workload)
    prof.disable()
    return pstats.Stats(prof)


def _our_calls(st: pstats.Stats) -> int:
    return sum(v[1] for k, v in st.stats.items() if _is_ours(k[0]))  # type: ignore[attr-defined]


def _edits_breakdown(st: pstats.Stats, calls: int, top: int = 10) -> tuple[float, list]:
    """(calls made from edits.py per hook call, the top entries per hook call: edits.py's functions with
    their own time, and what they call with its cumulative time)."""
    rows = []
    ops = 0
    for key, (_, nc, tt, _, callers) in st.stats.items():  # type: ignore[attr-defined]
        name = f"{Path(key[0]).name}:{key[2]}" if key[0] != "~" else key[2]
        if key[0].endswith(EDITS):  # our own functions there: their own time
            rows.append((tt / calls * 1e6, nc / calls, name))
            continue
        edges = [v for c, v in callers.items() if c[0].endswith(EDITS)]
        if edges:  # called from edits.py: the calls and time of those edges only
            n, t = sum(v[1] for v in edges), sum(v[3] for v in edges)
            ops += n
            rows.append((t / calls * 1e6, n / calls, name))
    rows.sort(reverse=True)
    return ops / calls, [f"{t:8.2f} us {n:7.2f}x {f}" for t, n, f in rows[:top]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workloads", default="W4n,W4b")
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()

    import torch

    from vllm_worker import counters

    torch.set_num_threads(1)
    llm = make_engine("llama", max_num_seqs=args.n, max_num_batched_tokens=max(2048, 8 * args.n))
    mid = llm.llm_engine.model_config.get_total_num_hidden_layers() // 2
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (8,), generator=g).tolist()} for _ in range(args.n)]

    def timed(workload, new):
        sp = _params(workload, mid, new)
        _run(llm, prompts, sp, workload)  # warm-up
        best, stats = float("inf"), None
        for _ in range(args.reps):
            before = dict(counters.HOOK_TIMINGS)
            t = time.perf_counter()
            _run(llm, prompts, sp, workload)
            wall = time.perf_counter() - t
            if wall < best:
                best = wall
                stats = {k: counters.HOOK_TIMINGS[k] - before[k] for k in before}
        assert stats is not None
        return best, stats

    base, _ = timed("W0", args.new)
    base2, _ = timed("W0", 2 * args.new)
    base_prof = None if args.no_profile else _profile(llm, prompts, _params("W0", mid, args.new), "W0")
    report: dict = {"n": args.n, "new": args.new, "W0_wall_s": round(base, 4)}
    for w in args.workloads.split(","):
        wall, stats = timed(w, args.new)
        wall2, stats2 = timed(w, 2 * args.new)
        calls = stats["calls"]
        row = {
            "wall_s": round(wall, 4),
            "hook_calls": calls,
            # the extra wall of the steps only: twice the new tokens against once, over W0's same difference
            "step_wall_us": round(((wall2 - wall) - (base2 - base)) / (stats2["calls"] - calls) * 1e6, 1),
            "ours_us": round(stats["around_hooks_s"] / calls * 1e6, 1),
            "in_fn_us": round(stats["in_hooks_s"] / calls * 1e6, 1),
        }
        if base_prof is not None:
            st = _profile(llm, prompts, _params(w, mid, args.new), w)
            row["py_calls"] = round((_our_calls(st) - _our_calls(base_prof)) / calls, 2)
            ops, row["top"] = _edits_breakdown(st, calls)
            row["ops"] = round(ops, 2)
        report[w] = row
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
