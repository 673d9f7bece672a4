"""What a re-plan costs the worker, per re-plan and per request admitted in it, on a real in-process CPU
engine (SmolLM2; 256 requests x 30 prompt tokens): the composition change's `_current_plan` (pruning, the
new requests' admission, the flush, `make_plan`) and, inside the next forward, the graph path's table fill
and upload (`GraphPlan.fill`, `GraphTaps.upload`). Counts that do not depend on the VM's load, from one
round run under a counter: aten ops dispatched, of them `_local_scalar_dense` (`.item()` / `.tolist()` of a
tensor: a wait for the device on a GPU), tensors handed to `to_device` (a host-to-device copy on a GPU) and
Python calls; then wall ms from rounds run without it (min over rounds).

Prints one line per workload: the first re-plan (step 0: the batch's first admissions) and the others
summed, each as ops / syncs / copies / calls per request admitted, and ms.

    python bench/probes/replan_cost.py [workloads, e.g. W11,W12,W12n,W13] [rounds]   (default all, 3)

Env: REPLAN_N (requests, 256), REPLAN_NEW (new tokens, 4)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import monitor_workloads as mw  # noqa: E402

N = int(os.environ.get("REPLAN_N", "256"))
NEW = int(os.environ.get("REPLAN_NEW", "4"))
PROFILE = os.environ.get("REPLAN_PROFILE", "")  # a pstats sort key: cProfile the first re-plan instead
ROWS = os.environ.get("REPLAN_ROWS") == "1"  # also print every counted re-plan


class Counter(TorchDispatchMode):
    """Aten ops dispatched and `.item()`-like reads (`_local_scalar_dense`) while entered."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


class Probe:
    """Wraps the runtime's re-plan and the graph step's fill / upload; `counting`: under `Counter` and a
    Python-call profile (slow: only for counts)."""

    def __init__(self) -> None:
        self.counting = False
        self.copies = 0
        self.rows: list[dict] = []  # one per re-plan: step, admitted, ops, syncs, copies, calls, ms
        self.forwards = 0
        self._cur: dict | None = None

    def install(self) -> None:
        from vllm_worker import compat
        from vllm_worker.worker import actions, admission, graph_entries, graph_table, plan, runtime
        from vllm_worker.worker.graph import GraphTaps
        from vllm_worker.worker.plan import GraphPlan

        probe = self
        for m in (admission, actions, graph_entries, graph_table, plan):
            f = m.to_device

            def moved(t, d, f=f):  # type: ignore[no-untyped-def]
                probe.copies += 1
                return f(t, d)

            m.to_device = moved  # type: ignore[attr-defined]
        rt = runtime.LensRuntime
        orig_plan = rt._current_plan

        def current_plan(self):  # type: ignore[no-untyped-def]
            req_ids, qsl = compat.batch_layout(self.runner)
            if (tuple(req_ids), qsl.tobytes()) == self._plan_key:
                return orig_plan(self)
            from vllm_worker import counters

            before = counters.STEP_TIMINGS["admitted"] + self.admission._since
            row = {"step": probe.forwards, "requests": len(req_ids)}
            got = probe.measured(row, lambda: orig_plan(self))
            row["admitted"] = counters.STEP_TIMINGS["admitted"] - before
            probe.rows.append(row)
            probe._cur = row
            return got

        rt._current_plan = current_plan
        orig_fwd = rt.around_forward

        def around_forward(self, *a, **k):  # type: ignore[no-untyped-def]
            try:
                return orig_fwd(self, *a, **k)
            finally:
                probe.forwards += 1
                probe._cur = None

        rt.around_forward = around_forward
        for cls, name in ((GraphPlan, "fill"), (GraphTaps, "upload")):
            orig = getattr(cls, name)

            def wrapped(*a, orig=orig, **k):  # type: ignore[no-untyped-def]
                row = probe._cur
                if row is None:
                    return orig(*a, **k)
                part: dict = {}
                got = probe.measured(part, lambda: orig(*a, **k))
                for key in ("ops", "syncs", "copies", "calls", "ms"):
                    row["fill_" + key] = row.get("fill_" + key, 0) + part.get(key, 0)
                return got

            setattr(cls, name, wrapped)

    def measured(self, row: dict, fn: Any) -> Any:
        c0 = self.copies
        if not self.counting:
            t = time.perf_counter()
            got = fn()
            row["ms"] = (time.perf_counter() - t) * 1e3
            return got
        if PROFILE and not self.rows:  # (the first re-plan: cProfile instead of counts)
            import cProfile
            import io
            import pstats

            pr = cProfile.Profile()
            got = pr.runcall(fn)
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats(PROFILE).print_stats(45)
            print(s.getvalue(), file=sys.stderr)
            return got
        calls = [0]

        def count(frame, event, arg):  # type: ignore[no-untyped-def]
            if event in ("call", "c_call"):
                calls[0] += 1

        with Counter() as c:
            sys.setprofile(count)
            try:
                got = fn()
            finally:
                sys.setprofile(None)
        row.update(ops=c.ops, syncs=c.syncs, calls=calls[0], copies=self.copies - c0)
        return got


def summary(rows: list[dict]) -> dict:
    """The first re-plan (the batch's first admissions) and the rest summed."""
    first, rest = rows[0], rows[1:]
    out = {"first": first}
    tot: dict = {}
    for r in rest:
        for k, v in r.items():
            if k != "step":
                tot[k] = tot.get(k, 0) + v
    out["rest"] = tot
    out["replans"] = len(rows)
    return out


def main() -> None:
    workloads = sys.argv[1].split(",") if len(sys.argv) > 1 else ["W11", "W12", "W12n", "W13"]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    from vllm import LLM, SamplingParams

    from vllm_worker.api import SteeringVector
    from vllm_worker.shipped_model import shipped_model_path

    probe = Probe()
    probe.install()
    llm = LLM(
        str(shipped_model_path()),
        dtype="float32",
        max_model_len=512,
        seed=0,
        max_num_seqs=N,
        kv_cache_memory_bytes=1 << 30,
        enforce_eager=True,
    )
    cfg = llm.llm_engine.model_config.hf_config
    n_layers, d = cfg.num_hidden_layers, cfg.hidden_size
    mw.load_probes(llm, n_layers, d)
    vec = torch.randn(1, d, generator=torch.Generator().manual_seed(3))
    mw.register_vectors(llm, vec)
    prompts = [{"prompt_token_ids": [(i * 7 + k) % 5000 + 3 for k in range(30)]} for i in range(N)]
    for w in workloads:
        sp = SamplingParams(
            max_tokens=NEW, temperature=0, ignore_eos=True, extra_args=mw.extra(w, n_layers, d, vec, SteeringVector)
        )
        llm.generate(prompts, sp, use_tqdm=False)  # warm-up
        times = []
        for r in range(rounds + 1):
            probe.counting = r == rounds
            probe.rows, probe.forwards = [], 0
            llm.generate(prompts, sp, use_tqdm=False)
            if probe.counting:
                counted = summary(probe.rows)
                if ROWS:
                    print(json.dumps(probe.rows), flush=True)
            else:
                times.append(summary(probe.rows))
        first_ms = sorted(t["first"]["ms"] + t["first"].get("fill_ms", 0) for t in times)
        rest_ms = sorted(t["rest"].get("ms", 0) + t["rest"].get("fill_ms", 0) for t in times)
        f, rs = counted["first"], counted["rest"]

        def per(row: dict) -> dict:
            n = max(1, row.get("admitted", 0))
            return {
                k: round((row.get(k, 0) + row.get("fill_" + k, 0)) / n, 1) for k in ("ops", "syncs", "copies", "calls")
            }

        print(
            json.dumps(
                {
                    "workload": w,
                    "replans": counted["replans"],
                    "first": {
                        "admitted": f.get("admitted"),
                        "ops": f.get("ops", 0),
                        "fill_ops": f.get("fill_ops", 0),
                        "syncs": f.get("syncs", 0) + f.get("fill_syncs", 0),
                        "copies": f.get("copies", 0) + f.get("fill_copies", 0),
                        "calls": f.get("calls", 0) + f.get("fill_calls", 0),
                        "per_request": per(f),
                        "ms_min": round(first_ms[0], 2),
                        "ms_med": round(first_ms[len(first_ms) // 2], 2),
                    },
                    "rest": {
                        "admitted": rs.get("admitted"),
                        "ops": rs.get("ops", 0) + rs.get("fill_ops", 0),
                        "syncs": rs.get("syncs", 0) + rs.get("fill_syncs", 0),
                        "copies": rs.get("copies", 0) + rs.get("fill_copies", 0),
                        "calls": rs.get("calls", 0) + rs.get("fill_calls", 0),
                        "per_request": per(rs),
                        "ms_min": round(rest_ms[0], 2),
                    },
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
