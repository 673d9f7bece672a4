"""Per steady decode step of W0 / W9 / W10 / W11 / W12 / W13 on the graph-safe path (a real in-process CPU
engine): what our code dispatches and calls. A GPU step is host-bound on the H200, so these counts are what
the host pays per step there; they do not depend on the VM's load.

For one decode step of an unchanged batch (`--step`, counted from the first decode step), the worker's step
(`execute_model` + `sample_tokens`):

- `ops`: aten ops dispatched by vllm_worker code (the innermost non-torch frame is ours), apart from the
  CPU twin of the tap kernel (`GraphTaps.apply` and below: `twin_ops`; the taps are inside a CUDA graph on a GPU), of which `apply_entries` in
  `twin_entries`): a GPU replays the kernel inside its CUDA graph. `views`: those of `ops` that launch
  nothing (views, metadata); `launch_ops` the rest, by name in `--names`.
- `py_calls`: Python function calls whose code lives in vllm_worker, and `c_calls` builtins / C functions
  called from vllm_worker frames (sys.setprofile; the twin's apart: `twin_py`).
- `host_ms`: our host time in the step on this CPU (`prepare_step`, `around_forward` less vLLM's forward,
  the stops after sampling; median over the decode steps from the third on of `--rounds` runs; the twin runs
  inside the forward and is excluded with it).

    python bench/probes/step_ops.py [--workloads W0,W9,W10,W11,W12,W13] [--new 16] [--step 8] [--rounds 3]
        [--names] [--save F.json]

`--save` writes every request's tokens, probe scores and action outcomes of one run per workload (torch.save)
for `--compare F.json` (torch.equal against a saved run of another tree).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

MODEL = "/root/.cache/inspect-lens/smollm2-135m-instruct-0.1.2-f32"
OURS = os.sep + "vllm_worker" + os.sep
THIS = os.path.abspath(__file__)
TAPS_FILE = os.sep + "worker" + os.sep + "taps.py"
TAP_FUNCS = ("hook", "_tap_split_impl", "_tap_impl")  # the taps: inside a CUDA graph on a GPU
VIEW_OPS = {
    "view",
    "_unsafe_view",
    "slice",
    "select",
    "narrow",
    "expand",
    "unsqueeze",
    "squeeze",
    "t",
    "transpose",
    "permute",
    "as_strided",
    "alias",
    "detach",
    "reshape",
    "lift_fresh",
    "_reshape_alias",
    "split",
    "unbind",
}


def _where(frame: Any) -> tuple[str, bool, bool]:
    """(owner of the innermost non-torch frame: "ours" / "vllm" / "other", inside the twin, inside
    apply_entries)."""
    owner = None
    twin = entries = False
    f = frame
    while f is not None:
        fn = f.f_code.co_filename
        if owner is None and "/torch/" not in fn and os.path.abspath(fn) != THIS:
            owner = "ours" if OURS in fn else ("vllm" if "/vllm/" in fn else "other")
        name = f.f_code.co_name
        if OURS in fn:
            if name in TAP_FUNCS and fn.endswith(TAPS_FILE):
                twin = True
            if name == "apply_entries":
                entries = True
        f = f.f_back
    return owner or "other", twin, entries


def _ours_line(frame: Any) -> str:
    f = frame
    while f is not None and OURS not in f.f_code.co_filename:
        f = f.f_back
    return "?" if f is None else f"{Path(f.f_code.co_filename).stem}:{f.f_lineno}"


class Ops(TorchDispatchMode):
    """Counts aten ops by owner; runs our tap op's implementation under itself (its ops are ours / twin)."""

    def __init__(self) -> None:
        super().__init__()
        self.c: Counter = Counter()
        self.names: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.__name__.split(".")[0]
        if func.namespace == "vllm_lens":  # its Python implementation, its ops seen one by one
            from vllm_worker.worker import taps

            impl = taps._tap_split_impl if name == "tap" else taps._tap_impl
            with self:
                return impl(*args, **(kwargs or {}))
        owner, twin, entries = _where(sys._getframe(1))
        if owner == "ours":
            if entries:
                self.c["twin_entries"] += 1
            if twin:
                self.c["twin_ops"] += 1
            else:
                self.c["ops"] += 1
                if name in VIEW_OPS:
                    self.c["views"] += 1
                else:
                    self.c["launch_ops"] += 1
                self.names[f"{name}@{_ours_line(sys._getframe(1))}"] += 1
        else:
            self.c[owner + "_ops"] += 1
        return func(*args, **(kwargs or {}))


class Calls:
    """sys.setprofile: Python calls into vllm_worker code and C calls from it (the twin's apart)."""

    def __init__(self) -> None:
        self.c: Counter = Counter()
        self.funcs: Counter = Counter()

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            fn = frame.f_code.co_filename
            if OURS in fn:
                twin = _in_twin(frame)
                self.c["twin_py" if twin else "py_calls"] += 1
                if not twin:
                    self.funcs[f"{Path(fn).stem}.{frame.f_code.co_name}"] += 1
        elif event == "c_call":
            if OURS in frame.f_code.co_filename:
                self.c["twin_c" if _in_twin(frame) else "c_calls"] += 1


def _in_twin(frame: Any) -> bool:
    f = frame
    while f is not None:
        if f.f_code.co_name in TAP_FUNCS and f.f_code.co_filename.endswith(TAPS_FILE):
            return True
        f = f.f_back
    return False


class Probe:
    """Wraps the worker's step: step numbering, the counting step, our host time per step."""

    def __init__(self, count_step: int) -> None:
        self.count_step = count_step
        self.step = -1  # decode steps seen (-1: before the first)
        self.mode: str | None = None
        self.ops: Ops | None = None
        self.calls: Calls | None = None
        self.host: list[float] = []
        self.ours_s = 0.0
        self.decode = False

    def install(self) -> None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        from vllm_worker.worker import actions, runtime

        probe = self
        exe, samp = GPUModelRunner.execute_model, GPUModelRunner.sample_tokens
        around = runtime.LensRuntime.around_forward

        def execute_model(runner, sched_out, *a, **k):  # type: ignore[no-untyped-def]
            n_new = len(sched_out.scheduled_new_reqs)
            probe.decode = n_new == 0 and sched_out.total_num_scheduled_tokens == len(sched_out.num_scheduled_tokens)
            if probe.decode:
                probe.step += 1
            probe.ours_s = 0.0
            probe._begin()
            try:
                return exe(runner, sched_out, *a, **k)
            finally:
                probe._pause()

        def sample_tokens(runner, *a, **k):  # type: ignore[no-untyped-def]
            probe._resume()
            try:
                return samp(runner, *a, **k)
            finally:
                probe._end()
                if probe.decode and probe.step >= 2:
                    probe.host.append(probe.ours_s * 1e3)

        def timed_ours(f):  # type: ignore[no-untyped-def]
            def g(*aa, **kk):  # type: ignore[no-untyped-def]
                t = time.perf_counter()
                try:
                    return f(*aa, **kk)
                finally:
                    probe.ours_s += time.perf_counter() - t

            return g

        def around_forward(rt, orig, *a, **k):  # type: ignore[no-untyped-def]
            def untimed(*aa, **kk):  # type: ignore[no-untyped-def]
                t = time.perf_counter()
                try:
                    return orig(*aa, **kk)
                finally:
                    probe.ours_s -= time.perf_counter() - t

            return around(rt, untimed, *a, **k)

        GPUModelRunner.execute_model = execute_model
        GPUModelRunner.sample_tokens = sample_tokens
        runtime.LensRuntime.around_forward = timed_ours(around_forward)
        runtime.LensRuntime.prepare_step = timed_ours(runtime.LensRuntime.prepare_step)
        actions.ActionTable.stops = timed_ours(actions.ActionTable.stops)

    def _begin(self) -> None:
        self.mode = None
        if self.decode and self.step == self.count_step:
            self.mode = "calls"
            self.calls = Calls()
        elif self.decode and self.step == self.count_step + 1:
            self.mode = "ops"
            self.ops = Ops()
        self._resume()

    def _resume(self) -> None:
        if self.mode == "calls":
            sys.setprofile(self.calls)
        elif self.mode == "ops":
            assert self.ops is not None
            self.ops.__enter__()

    def _pause(self) -> None:
        if self.mode == "calls":
            sys.setprofile(None)
        elif self.mode == "ops":
            assert self.ops is not None
            self.ops.__exit__(None, None, None)

    def _end(self) -> None:
        self._pause()
        self.mode = None


def outputs_of(outs: list) -> dict:
    """Every request's tokens, probe scores / aggregates and action outcomes (for --save / --compare)."""
    got: dict = {}
    for o in outs:
        d: dict = {"tokens": torch.tensor(o.outputs[0].token_ids)}
        acts = getattr(o, "activations", None) or {}
        for name, s in (acts.get("probe_scores") or {}).items():
            d[f"score.{name}"] = s.clone()
        for k, v in acts.items():
            if k not in ("probe_scores",):
                d[f"act.{k}"] = repr(v)
        got[o.request_id] = d
    return got


def micro(steps: int = 200) -> None:
    """Without an engine: the probe part of a steady W9 / W10 step as `runtime._graph_step` runs it (ring
    base, `set_base`, `scores_from_stage`) on a bf16 ring (256 rows x 576 a step, 8192 rows a forward at
    most, as the engine's), with the projection's CPU path
    and with its GPU path (`rowwise=False`: the ops a GPU dispatches, run on CPU tensors): aten ops of the
    last step, by name; host us a step (min, median over the steps after the first 8, one torch thread).
    Runs against any tree (PYTHONPATH), for before / after."""
    import inspect
    from types import SimpleNamespace

    import numpy as np

    from vllm_worker.protocol.points import canonical_site
    from vllm_worker.protocol.wire import tensor_to_bytes
    from vllm_worker.worker import graph, probes
    from vllm_worker.worker.request_results import RequestResults

    n, d = 256, 576
    keeps = "copied" in inspect.signature(graph.GraphTaps.ring_alloc).parameters
    for w, layers in (("W9", [15]), ("W10", [9, 13, 17, 21])):
        for path in ("cpu", "gpu"):
            g = graph.GraphTaps(
                [canonical_site("resid_post", l) for l in layers], d, torch.bfloat16, torch.device("cpu"), 8192, None
            )
            wp = probes.WorkerProbes(torch.device("cpu"), frozenset(range(30)))
            gen = torch.Generator().manual_seed(1)
            names = []
            for j, layer in enumerate(layers * (1 if w == "W9" else 2)):
                wire = {"layers": [layer], "point": "resid_post", "output": "logit"}
                wp.load(f"p{j}", f"p{j}", {**wire, "weight": tensor_to_bytes(torch.randn(1, d, generator=gen))})
                names.append(f"p{j}")
            uses = wp.uses([{"probe": x, "uid": x} for x in names])
            reqs = [SimpleNamespace(probes=uses, sae=[], store=RequestResults([])) for _ in range(n)]
            sites = sorted({s for u in uses for s in u.weights})
            gp = SimpleNamespace(
                n=n, cap_rows=np.zeros(0, np.int64), cap_cols=np.zeros(0, np.int64), n_extra=0, probes={}, sae={}
            )
            items = [(r, i, i + 1) for i, r in enumerate(reqs)]
            probes.stage_probes(gp, {s: items for s in sites}, g.col, lambda it: np.arange(len(it), dtype=np.int64))
            total = gp.total = len(gp.cap_rows)
            orig = probes.project
            if path == "gpu":
                probes.project = lambda *a, **k: orig(*a, **{**k, "rowwise": False})  # type: ignore[assignment]
            try:
                last: Counter = Counter()
                times = []
                g.stage[: total + 8].normal_(generator=gen)
                for k in range(steps):
                    pos = np.arange(n, dtype=np.int64) + 30 + k
                    ops = Ops() if k == steps - 1 else contextlib.nullcontext()
                    t = time.perf_counter()
                    with ops:
                        base = g.ring_alloc(total, False) if keeps else g.ring_alloc(total)
                        assert base is not None
                        g.set_base(base)
                        probes.scores_from_stage(gp, g.stage, base, pos)
                    times.append(time.perf_counter() - t)
                    if isinstance(ops, Ops):
                        last = Counter(f.split("@")[0] for f in ops.names.elements())
            finally:
                probes.project = orig
            us = sorted(times[8:-1])
            line = {"micro": w, "projection": path, "ops": sum(last.values()), "names": dict(last)}
            line |= {"us_min": round(us[0] * 1e6, 1), "us_median": round(us[len(us) // 2] * 1e6, 1)}
            print(json.dumps(line), flush=True)


def main() -> None:
    if "--micro" in sys.argv:
        torch.set_num_threads(1)
        return micro()
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="W0,W9,W10,W11,W12,W13")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--step", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--names", action="store_true")
    ap.add_argument("--funcs", action="store_true")
    ap.add_argument("--save")
    ap.add_argument("--compare")
    ap.add_argument("--eager", action="store_true")
    a = ap.parse_args()
    import monitor_workloads as mw
    from vllm import LLM, SamplingParams

    from vllm_worker.api import SteeringVector

    llm = LLM(
        MODEL,
        dtype="float32",
        max_model_len=512,
        seed=0,
        max_num_seqs=a.n,
        kv_cache_memory_bytes=2 << 30,
        enforce_eager=a.eager,
    )
    cfg = llm.llm_engine.model_config.hf_config
    n_layers, d = cfg.num_hidden_layers, cfg.hidden_size
    mw.load_probes(llm, n_layers, d)
    vec = torch.randn(1, d, generator=torch.Generator().manual_seed(5))
    prompts = [{"prompt_token_ids": [(i * 7 + k) % 5000 + 3 for k in range(30)]} for i in range(a.n)]
    probe = Probe(a.step)
    probe.install()
    saved: dict = {}
    ref = torch.load(a.compare) if a.compare else None
    for w in a.workloads.split(","):
        xa = None if w == "W0" else mw.extra(w, n_layers, d, vec, SteeringVector)
        sp = SamplingParams(max_tokens=a.new, temperature=0, ignore_eos=True, extra_args=xa)
        host: list[float] = []
        counts: dict = {}
        for r in range(a.rounds):
            probe.step, probe.host = -1, []
            probe.ops, probe.calls = None, None
            outs = llm.generate(prompts, sp, use_tqdm=False)
            host += probe.host
            if r == 0:
                mw.check(w, outs, 30, a.new, 1536) if w != "W0" else None
                got = outputs_of(outs)
                saved[w] = got
                if ref is not None:
                    bad = [
                        (rid, k)
                        for rid, dd in got.items()
                        for k, v in dd.items()
                        if not (torch.equal(v, ref[w][rid][k]) if isinstance(v, torch.Tensor) else v == ref[w][rid][k])
                    ]
                    print(w, "compare:", "EQUAL" if not bad else f"DIFFER {bad[:5]} ({len(bad)})", flush=True)
            if probe.ops is not None and probe.calls is not None and not counts:
                counts = {**probe.ops.c, **probe.calls.c}
                if a.names:
                    counts["names"] = dict(probe.ops.names.most_common())
                if a.funcs:
                    counts["funcs"] = dict(probe.calls.funcs.most_common())
        line = {
            "workload": w,
            **{k: counts.get(k, 0) for k in ("ops", "launch_ops", "views", "py_calls", "c_calls")},
            "twin": {k: counts.get(k, 0) for k in ("twin_ops", "twin_entries", "twin_py", "twin_c")},
            "vllm_ops": counts.get("vllm_ops", 0),
            "host_ms_median": round(statistics.median(host), 3) if host else None,
            "host_ms_min": round(min(host), 3) if host else None,
            "steps": len(host),
        }
        for k in ("names", "funcs"):
            if k in counts:
                line[k] = counts[k]
        print(json.dumps(line), flush=True)
    if a.save:
        torch.save(saved, a.save)


if __name__ == "__main__":
    main()
