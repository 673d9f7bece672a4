"""Admission cost of steering on the graph-safe path, on CPU: W12's request (ablate one direction at every
layer of an 8B-shaped model: d = 4096, 32 layers), W13's (cap at one layer) and W11's (a probe action at
the middle layer, `then: steer` one layer later: its payload made by the frontend's `parse_request`),
admitted through the worker's `Admission` (payload decode, action slots, entries, the step's flush) into
tables like the H200 run's. Prints ms per request (min and median of `ADMIT_REPEATS` batches, default 5)
and the table's entries in use; then, load-independent, the aten ops of one batch (admissions and flush: on
a GPU the flush's are launches, the others host work) and the bytes it hands to the device (`to_device`).
`ADMIT_CONTENTS=k`: requests alternate between k vectors; `ADMIT_TEMPLATES=0`: no admission templates.
Run: `[ADMIT_STEADY=1] python bench/probes/admit_cost.py [n_requests] [workloads, e.g. W11,W12]`."""

from __future__ import annotations

import gc
import os
import sys
import time
import types
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_worker import compat
from vllm_worker.api.steering import SteeringVector
from vllm_worker.frontend.validation import parse_request
from vllm_worker.protocol.ops import ABLATE, CAP
from vllm_worker.protocol.points import OUT, site
from vllm_worker.protocol.spec import ModelShape, RequestSpec, Steer, encode
from vllm_worker.worker import actions as actions_mod
from vllm_worker.worker import admission as admission_mod
from vllm_worker.worker import graph, graph_entries
from vllm_worker.worker.actions import ActionTable
from vllm_worker.worker.admission import Admission
from vllm_worker.worker.store import CaptureStore

D, LAYERS = 4096, 32
REPEATS = int(os.environ.get("ADMIT_REPEATS", "5"))  # batches per workload (min and median reported)
STEADY = os.environ.get("ADMIT_STEADY") == "1"  # one torch thread, no garbage collection inside a batch
CONTENTS = int(os.environ.get("ADMIT_CONTENTS", "1"))  # distinct vectors, request i sends number i % CONTENTS
TEMPLATES = os.environ.get("ADMIT_TEMPLATES") != "0"  # 0: admission templates off (`Templates.kept = 0`)


class Counts(TorchDispatchMode):
    """Aten ops dispatched, and bytes handed to `to_device` by admission, the action table and the entries."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.bytes = 0
        self._saved = [(m, m.to_device) for m in (admission_mod, actions_mod, graph_entries)]

    def __enter__(self):  # type: ignore[no-untyped-def]
        for m, f in self._saved:
            m.to_device = lambda t, d, f=f: self._moved(t) or f(t, d)  # type: ignore[attr-defined]
        return super().__enter__()

    def __exit__(self, *a):  # type: ignore[no-untyped-def]
        for m, f in self._saved:
            m.to_device = f  # type: ignore[attr-defined]
        return super().__exit__(*a)

    def _moved(self, t: torch.Tensor) -> None:
        self.bytes += t.numel() * t.element_size()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


class Runner:
    """What admission reads of vLLM's model runner for a probe action: each request's prompt length."""

    def __init__(self, n: int) -> None:
        self.requests = {f"r{i}": types.SimpleNamespace(num_prompt_tokens=30) for i in range(n)}


def payload(workload: str, i: int, unit: torch.Tensor) -> dict:
    if workload == "W11":  # (`bench/monitor_workloads.py`: a direction stands for the loaded probe "m1")
        steer = SteeringVector(activations=unit.view(1, D).clone(), layer_indices=[LAYERS // 2 + 1], scale=1.0)
        act = {"direction": unit.tolist(), "layer": LAYERS // 2, "threshold": -1e9, "then": {"steer": steer}}
        spec = parse_request({"probe_actions": [act]}, ModelShape(n_layers=LAYERS, d_model=D), 30)
        assert spec is not None
        return encode(spec)
    if workload == "W12":
        st = Steer([site(l, OUT) for l in range(LAYERS)], unit.expand(LAYERS, D).clone(), None, 1.0, False, op=ABLATE)
    else:
        st = Steer([site(LAYERS // 2, OUT)], unit.view(1, D).clone(), None, 1.0, False, op=CAP, lo=-1.0, hi=1.0)
    return encode(RequestSpec(key=f"k{i}", steers=[st]))


def admission(g: graph.GraphTaps, n: int = 0, actions: ActionTable | None = None) -> Admission:
    """The worker's admission with what a steering request touches (no hooks, SAEs, probes); `actions`:
    with a probe action table (and a runner knowing `n` requests' prompt lengths)."""
    sites = frozenset(site(l, OUT) for l in range(LAYERS))
    store = CaptureStore(torch.device("cpu"))
    args = (Runner(n), torch.device("cpu"), torch.bfloat16, D, sites, frozenset(range(LAYERS)), {}, True, None, store)
    return Admission(*args, g, None, None, actions=actions)  # type: ignore[arg-type]


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    workloads = sys.argv[2].split(",") if len(sys.argv) > 2 else ["W11", "W12", "W13"]
    os.environ.setdefault("VLLM_LENS_STEER_MB", "64")
    if STEADY:  # (on a shared VM: a collection over vLLM's objects, ~0.3 s here, lands in some batch)
        torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    units = [torch.nn.functional.normalize(torch.randn(D, generator=gen), dim=0) for _ in range(CONTENTS)]
    compat.pp_last_stage()  # (its first call imports vLLM's distributed modules: not a request's cost)
    for workload in workloads:
        msgs = [payload(workload, i, units[i % CONTENTS]) for i in range(n)]
        runs = [one_run(workload, msgs) for _ in range(REPEATS)]
        admit = sorted(r[0] for r in runs)
        flush = sorted(r[1] for r in runs)
        counts = Counts()
        with counts:
            one_run(workload, msgs)
        calls = python_calls(workload, msgs)
        print(
            f"{workload}: {n} requests, admit {admit[0]:.3f} ms/request (min of {REPEATS}; median "
            f"{admit[REPEATS // 2]:.3f}), flush {flush[0]:.1f} ms (min), {runs[-1][2]}; a batch: "
            f"{counts.ops} aten ops, {counts.bytes} bytes to the device, {calls / n:.0f} Python calls a request"
        )


def python_calls(workload: str, msgs: list[dict]) -> int:
    """Python-level function calls (and calls into C) of one batch's admissions and flush: a count that
    does not depend on the machine's load."""
    got = [0]

    def count(frame, event, arg):  # type: ignore[no-untyped-def]
        if event in ("call", "c_call"):
            got[0] += 1

    one_run(workload, msgs, count)
    return got[0]


def one_run(workload: str, msgs: list[dict], profile: Any = None) -> tuple[float, float, str]:
    """One batch of admissions into fresh tables: ms per request, the flush's ms, and what they hold;
    `profile`: a `sys.setprofile` function for the admissions and the flush."""
    n = len(msgs)
    g = graph.GraphTaps([site(l, OUT) for l in range(LAYERS)], D, torch.bfloat16, torch.device("cpu"), 256, None)
    actions = ActionTable(D, torch.device("cpu")) if workload == "W11" else None
    adm = admission(g, n, actions)
    if not TEMPLATES:
        adm.templates.kept = 0
    if STEADY:
        gc.collect()
        gc.disable()
    sys.setprofile(profile)
    t0 = time.perf_counter()
    states = [adm.admit(f"r{i}", m) for i, m in enumerate(msgs)]
    t1 = time.perf_counter()
    adm.flush()
    t2 = time.perf_counter()
    sys.setprofile(None)
    gc.enable()
    failed = [s.store.error for s in states if s.store is not None and s.store.error is not None]
    assert not failed, failed[0]
    on_graph = sum(s.entries is not None for s in states)
    held = f"entries in use {g.entries.in_use()} of {g.A.shape[0]}, graph-safe requests {on_graph}"
    for s in states:
        g.free_entries(s.entry_ids)
        if actions is not None:
            actions.free(s.acts)
    assert g.entries.in_use() == 0, "entries left after every request left"
    return 1e3 * (t1 - t0) / n, 1e3 * (t2 - t1), held


if __name__ == "__main__":
    main()
