"""Where the worker's host time goes at the steps whose batch composition changes (a batch's admission steps,
the steps its requests leave at), per workload, in a real in-process engine (GPU with CUDA graphs, or the CPU
engine): the bench's batch (256 prompts x 30 tokens -> `--new` tokens, greedy) run `--rounds` times; for the
last round, per step, the wall ms of `execute_model` and the ms spent in named parts of ours (timers around
them: `PARTS`), then the functions of ours with the most own time over the round's changed steps (cProfile
of those steps only, in a further round: the timers are read without it). The bench gives the rounds' ratios;
this says which of our functions a changed step pays for, on the host that runs it.

    python bench/probes/step_host.py MODEL [--device cuda] [--workloads W9,W10,W11,W12,W13] [--new 128]
        [--stagger 4] [--arrive 4] [--settle] [--sync-debug]

`--stagger k`: request i asks for `new - i % k` tokens, so that the batch leaves over k steps (each a new
composition of those left), as the bench's engine, admitting over k steps, sees its requests leave.
`--arrive k`: the batch is added in k equal groups, one before each of the engine's first k steps
(`LLMEngine.add_request` / `step`), as the bench's engine in its own process receives it: admissions while
an earlier group's prefill is still on the device (async scheduling), which `generate` in one process never shows.
`--settle`: after every round, one plain 1-token request, as the bench runs between rounds (its `held settled`
check): the round's requests leave in that step, their steering chains with them, so the next round's first
admission adds its chains to the table again, as each of the bench's rounds does.
`--sync-debug` (CUDA, `--rounds` >= 2): the changed steps of the round before the timed one run under
`torch.cuda.set_sync_debug_mode("warn")`, and every host-device synchronisation there is counted by where it was
called (the innermost frames of ours or vLLM's): a step whose host waits for the step still on the device shows
it (vLLM's own syncs included).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import os
import pstats
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

# (module, owner attribute or "", function): the parts timed per step
PARTS = [
    ("vllm_worker.worker.runtime", "LensRuntime", "_current_plan"),
    ("vllm_worker.worker.runtime", "LensRuntime", "_active"),
    ("vllm_worker.worker.plan", "", "make_plan"),
    ("vllm_worker.worker.admission", "Admission", "admit"),
    ("vllm_worker.worker.admission", "Admission", "flush"),
    ("vllm_worker.worker.graph", "GraphTaps", "host_ctl"),
    ("vllm_worker.worker.graph", "GraphTaps", "upload"),
    ("vllm_worker.worker.probes", "", "scores_from_stage"),
    ("vllm_worker.worker.probes", "StagedProbes", "_open"),
    ("vllm_worker.worker.runtime", "LensRuntime", "_observe"),
]


class Timers:
    def __init__(self) -> None:
        self.t: collections.Counter = collections.Counter()

    def install(self) -> None:
        import importlib

        for mod, owner, name in PARTS:
            m = importlib.import_module(mod)
            where = getattr(m, owner) if owner else m
            f = getattr(where, name, None)
            if f is None:
                continue
            setattr(where, name, self._wrap(f, f"{owner or mod.rsplit('.', 1)[-1]}.{name}"))

    def _wrap(self, f: Any, label: str) -> Any:
        t = self.t

        def timed(*a: Any, **k: Any) -> Any:
            s = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                t[label] += (time.perf_counter() - s) * 1e3

        return timed


def bench_engine(model: str, device: str, n: int) -> tuple[Any, Any, list[dict]]:
    """(in-process `LLM` with the monitor probes loaded, workload -> its `extra_args`, the bench's `n`
    prompts of 30 tokens): the bench's engine and batch (bfloat16 dummy weights on a GPU, float32 on CPU)."""
    import monitor_workloads as mw
    import torch
    from system_base import engine_room
    from vllm import LLM

    from vllm_worker.api import SteeringVector

    gpu = device != "cpu"
    kw: dict = dict(model=model, seed=0, max_model_len=1024, enable_prefix_caching=False, **engine_room(device))
    kw["dtype"] = "bfloat16" if gpu else "float32"
    if gpu:
        kw["load_format"] = "dummy"
    llm = LLM(**kw)
    cfg = llm.llm_engine.model_config.hf_config
    n_layers, d = cfg.num_hidden_layers, cfg.hidden_size
    mw.load_probes(llm, n_layers, d)
    vec = torch.randn(1, d, generator=torch.Generator().manual_seed(5))
    prompts = [{"prompt_token_ids": [(i * 7 + k) % 5000 + 3 for k in range(30)]} for i in range(n)]
    return llm, (lambda w: None if w == "W0" else mw.extra(w, n_layers, d, vec, SteeringVector)), prompts


def bench_args(workloads: str, rounds: int, top: int) -> argparse.ArgumentParser:
    """The options of a probe over `bench_engine`'s engine: the model, device, batch (`--n` prompts ->
    `--new` tokens), workloads, rounds and how many profiled functions to print."""
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workloads", default=workloads)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--top", type=int, default=top)
    return ap


def main() -> None:
    ap = bench_args("W9,W10,W11,W12,W13", rounds=2, top=18)
    ap.add_argument("--stagger", type=int, default=1)
    ap.add_argument("--arrive", type=int, default=1, help="add the batch in this many groups, one a step")
    ap.add_argument("--settle", action="store_true", help="one plain 1-token request after every round")
    ap.add_argument("--sync-debug", action="store_true", help="count host-device syncs in changed steps (CUDA)")
    a = ap.parse_args()
    if a.sync_debug and (a.device != "cuda" or a.rounds < 2):
        ap.error("--sync-debug needs --device cuda and --rounds 2 or more (it watches the round before the timed one)")
    from vllm import SamplingParams
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    llm, extra, prompts = bench_engine(a.model, a.device, a.n)
    timers = Timers()
    timers.install()
    steps: list[tuple[float, int, int, dict]] = []  # (ms, new requests, finished requests, parts)
    prof: dict[str, Any] = {"p": None}
    syncs = SyncSites() if a.sync_debug else None
    exe = GPUModelRunner.execute_model

    def execute_model(runner: Any, so: Any, *args: Any, **kw2: Any) -> Any:
        changed = bool(so.scheduled_new_reqs) or bool(so.finished_req_ids)
        p = prof["p"] if changed else None
        timers.t.clear()
        t = time.perf_counter()
        watch = syncs is not None and changed and syncs.on
        if p is not None:
            p.enable()
        try:
            if watch:
                with syncs.watching(len(steps)):
                    return exe(runner, so, *args, **kw2)
            return exe(runner, so, *args, **kw2)
        finally:
            if p is not None:
                p.disable()
            steps.append(
                ((time.perf_counter() - t) * 1e3, len(so.scheduled_new_reqs), len(so.finished_req_ids), dict(timers.t))
            )

    GPUModelRunner.execute_model = execute_model
    print(f"STEP_HOST device={a.device} model={a.model} n={a.n} new={a.new}", flush=True)
    for w in a.workloads.split(","):
        xa = extra(w)
        sp = [
            SamplingParams(max_tokens=a.new - i % a.stagger, temperature=0, ignore_eos=True, extra_args=xa)
            for i in range(a.n)
        ]
        walls = []
        for r in range(a.rounds + 1):
            steps.clear()
            prof["p"] = cProfile.Profile() if r == a.rounds else None
            if syncs is not None:  # (the round before the timed one: its waits, not their cost in the timings)
                syncs.on = r == a.rounds - 2
            t = time.perf_counter()
            run_round(llm, prompts, sp, a.arrive, f"{w}-{r}")
            walls.append(round(time.perf_counter() - t, 3))
            if a.settle:  # (its step is the last of this round's `steps`: the round's requests leave there)
                llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)
            if r == a.rounds - 1:
                timed = list(steps)
        print(f"== {w} walls {walls} (the last with cProfile)", flush=True)
        for i, (ms, new, fin, parts) in enumerate(timed):
            if new or fin or i < 2:
                cells = " ".join(f"{k}={v:.2f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
                print(f"  step {i:3d} exec {ms:7.2f} ms new {new:3d} left {fin:3d} | {cells}", flush=True)
        if syncs is not None:
            syncs.report()
        steady = sorted(ms for ms, new, fin, _ in timed[5:-5] if not new and not fin)
        if steady:
            print(f"  steady steps: {len(steady)}, exec median {steady[len(steady) // 2]:.2f} ms", flush=True)
        s = io.StringIO()
        pstats.Stats(prof["p"], stream=s).sort_stats("tottime").print_stats("vllm_worker", a.top)
        print("\n".join(line for line in s.getvalue().splitlines() if "vllm_worker" in line or "ncalls" in line))


def run_round(llm: Any, prompts: list[dict], sps: list, arrive: int, tag: str) -> None:
    """One round of the batch: `generate` at once, or (`arrive` > 1) in `arrive` groups, each added before
    one engine step, then stepped until every request is done."""
    if arrive <= 1:
        llm.generate(prompts, sps, use_tqdm=False)
        return
    eng = llm.llm_engine
    n = len(prompts)
    per = -(-n // arrive)
    i = done = 0
    while i < n or eng.has_unfinished_requests():
        for j in range(i, min(i + per, n)):
            eng.add_request(f"sh-{tag}-{j}", prompts[j], sps[j])
        i = min(i + per, n)
        done += sum(1 for o in eng.step() if o.finished)
    if done != n:
        raise RuntimeError(f"run_round {tag}: {done} of {n} requests finished")


class SyncSites:
    """Host-device synchronisations inside chosen steps, by the step and the frames that called them
    (torch's sync debug mode warns at each; the warning's Python stack names the caller)."""

    def __init__(self) -> None:
        self.on = False
        self.by_step: dict[int, collections.Counter] = {}

    @contextlib.contextmanager
    def watching(self, step: int) -> Iterator[None]:
        import torch

        seen = self.by_step.setdefault(step, collections.Counter())

        def record(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            frames = [
                f"{Path(f.filename).name}:{f.lineno} {f.name}"
                for f in traceback.extract_stack()[:-1]
                if "vllm_worker" in f.filename or "/vllm/" in f.filename
            ]
            seen[" <- ".join(reversed(frames[-3:])) or str(message)[:80]] += 1

        with warnings.catch_warnings():  # (restores `showwarning` and the filters on the way out)
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")

    def report(self) -> None:
        print("  host-device syncs in the changed steps (step: count x innermost frames):", flush=True)
        for step, seen in sorted(self.by_step.items()):
            if not seen:
                print(f"   step {step:3d}: none", flush=True)
            for where, n in seen.most_common(6):
                print(f"   step {step:3d}: {n} x {where}", flush=True)
        self.by_step.clear()


if __name__ == "__main__":
    main()
