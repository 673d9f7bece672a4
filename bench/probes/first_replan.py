"""A batch's first re-plan on the worker, without an engine: W11 / W12 / W13 requests (8B shape: d = 4096,
32 layers; payloads made by the frontend's `parse_request`) admitted one by one (`Admission.admit`), the
step's flush, the graph-path plan of them all as 30-token prefills (`make_plan`) and its table filled and
uploaded (`GraphPlan.fill`, `GraphTaps.upload`): what the engine does before a batch's first forward.

Prints per workload, for one batch: aten ops dispatched (and of them `_local_scalar_dense`: a host sync on a
GPU), tensors handed to `to_device` (a host-to-device copy on a GPU), Python calls per request, ms per
request (min / median of `REPLAN_REPEATS`; batches after the worker's first, which finds nothing remembered)
and a SHA-256 over everything the worker's first batch and a later one leave on the "device"
(the entry, control and action tables) and in each request's state: equal digests before / after a change
say the change is bit-identical on this batch. `REPLAN_TOP=k`: the k functions called most.

    python bench/probes/first_replan.py [n_requests] [workloads, e.g. W11,W12,W13]   (default 137, all)"""

from __future__ import annotations

import collections
import gc
import hashlib
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import admit_cost  # noqa: E402
import monitor_workloads as mw  # noqa: E402
from admit_cost import LAYERS, Counts, D  # noqa: E402

from vllm_worker.api.steering import SteeringVector  # noqa: E402
from vllm_worker.frontend.validation import parse_request  # noqa: E402
from vllm_worker.protocol.points import OUT, site  # noqa: E402
from vllm_worker.protocol.spec import ModelShape, encode  # noqa: E402
from vllm_worker.worker import graph  # noqa: E402
from vllm_worker.worker import plan as plan_mod  # noqa: E402
from vllm_worker.worker.actions import ActionTable  # noqa: E402

PROMPT = 30
REPEATS = int(os.environ.get("REPLAN_REPEATS", "7"))
TOP = int(os.environ.get("REPLAN_TOP", "0"))


def payloads(workload: str, n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    vec = torch.randn(1, D, generator=gen)
    unit = torch.nn.functional.normalize(vec[0], dim=0)
    if workload == "W11":  # (a direction standing for the loaded probe: `admit_cost.payload`)
        return [admit_cost.payload("W11", i, unit) for i in range(n)]
    out = []
    for _ in range(n):
        extra = mw.extra(workload, LAYERS, D, vec, SteeringVector)
        spec = parse_request(extra, ModelShape(n_layers=LAYERS, d_model=D), PROMPT)
        assert spec is not None
        out.append(encode(spec))
    return out


class Worker:
    """What a worker keeps across batches: the graph taps, the action table and admission (its memos and
    templates: a batch after the first finds them, as every timed round of the bench does)."""

    def __init__(self, workload: str, n: int) -> None:
        self.sites = [site(l, OUT) for l in range(LAYERS)]
        self.g = graph.GraphTaps(self.sites, D, torch.bfloat16, torch.device("cpu"), PROMPT * n, None)
        self.actions = ActionTable(D, torch.device("cpu")) if workload == "W11" else None
        self.adm = admit_cost.admission(self.g, n, self.actions)

    def leave(self, states: list) -> None:
        """The batch's requests leave (their entries and slots given back) and the table is cleared."""
        for st in states:
            self.g.free_entries(st.entry_ids)
            if self.actions is not None:
                self.actions.free(st.acts)
        assert self.g.entries.in_use() == 0, "entries left after every request left"
        self.g.clear()


def one_batch(wk: Worker, msgs: list[dict], profile: Any = None) -> tuple[list[float], tuple]:
    """Admissions, flush, plan, fill and upload of one batch: (seconds at the end of each phase from the
    start, what `digest` reads). The caller lets the requests go (`Worker.leave`)."""
    n = len(msgs)
    g, actions, adm, sites = wk.g, wk.actions, wk.adm, wk.sites
    pos = np.tile(np.arange(PROMPT, dtype=np.int64), n)
    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    t0 = time.perf_counter()
    states = [adm.admit(f"r{i}", m) for i, m in enumerate(msgs)]
    t1 = time.perf_counter()
    adm.flush()
    t2 = time.perf_counter()
    active = [(st, PROMPT * i, PROMPT * (i + 1)) for i, st in enumerate(states)]
    plan = plan_mod.make_plan(active, torch.device("cpu"), True, frozenset(sites), g, PROMPT * n, False)
    t3 = time.perf_counter()
    gp = plan.graph
    assert gp is not None, "not planned for the graph path"
    ctl = g.host_ctl(gp.n, gp.live_cols)
    gp.fill(ctl, pos)
    g.upload(gp.n, gp.live_cols, gp if gp.steady else None)
    t4 = time.perf_counter()
    sys.setprofile(None)
    gc.enable()
    failed = [s.store.error for s in states if s.store is not None and s.store.error is not None]
    assert not failed, failed[0]
    return [t - t0 for t in (t1, t2, t3, t4)], (g, actions, states, gp)


def digest(g: graph.GraphTaps, actions: ActionTable | None, states: list, gp: Any) -> str:
    """SHA-256 of the device tables and of every request's state and the plan's arrays."""
    h = hashlib.sha256()
    e = g.entries
    for t in (e.A, e.B, e.bflag, e.op, e.nxt, e.lo, e.hi, e.gate, g.table.ctl):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    h.update(repr((e._refs, e._free, sorted(e._chains.items(), key=repr))).encode())
    if actions is not None:
        for name in ("W", "B", "thr", "kind", "sigmoid", "param", "count", "ema", "fired", "fire_pos", "gate"):
            h.update(getattr(actions, name).contiguous().view(torch.uint8).numpy().tobytes())
        h.update(repr((actions.first.tolist(), actions.until.tolist(), actions._free, actions._wfree)).encode())
    for st in states:
        ents = (
            None
            if st.entries is None
            else sorted((k, v[0], v[1].tolist(), v[2].tolist(), v[3], v[4]) for k, v in st.entries.items())
        )
        acts = [(u.index, u.slot, sorted(u.sites.items()), u.entries, u.every_row, u.rows, u.kind) for u in st.acts]
        steers = [(sorted(s.layers.items()), s.op, s.scale, s.lo, s.hi, s.digest, s.gate is None) for s in st.steers]
        h.update(repr((ents, st.entry_ids, acts, steers, sorted(st.simple_add))).encode())
        for s in st.steers:
            h.update(s.vectors.contiguous().view(torch.uint8).numpy().tobytes())
            if s.gate is not None:
                h.update(repr((s.gate.data_ptr() - actions.gate.data_ptr()) if actions is not None else 0).encode())
    for a in (gp.cap_rows, gp.cap_cols, gp.st_rows, gp.st_cols, gp.st_ents):
        h.update(np.ascontiguousarray(a).tobytes())
    h.update(repr([(s, e, c, p.tolist(), x.tolist(), d, gn, sp) for s, e, c, p, x, d, gn, sp in gp.st_pos]).encode())
    h.update(repr([a.tolist() for a in gp.ph]).encode())
    h.update(repr({k: (v[0].tolist(), v[1].tolist()) for k, v in gp.act.items()}).encode())
    return h.hexdigest()[:16]


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 137
    workloads = sys.argv[2].split(",") if len(sys.argv) > 2 else ["W11", "W12", "W13"]
    os.environ.setdefault("VLLM_LENS_STEER_MB", "64")
    torch.set_num_threads(1)
    for w in workloads:
        msgs = payloads(w, n)
        wk = Worker(w, n)

        def batch(profile: Any = None, dig: bool = False) -> tuple[list[float], str]:
            times, got = one_batch(wk, msgs, profile)
            d = digest(*got) if dig else ""
            wk.leave(got[2])
            return times, d

        first = batch(dig=True)[1]  # (the worker's first batch: nothing remembered yet)
        phases = [batch()[0] for _ in range(REPEATS)]
        times = sorted(p[-1] for p in phases)
        counts = Counts()
        with counts:
            syncs = Syncs()
            with syncs:
                _, got = one_batch(wk, msgs)
        dig = digest(*got)
        wk.leave(got[2])
        calls = collections.Counter()

        def count(frame, event, arg):  # type: ignore[no-untyped-def]
            if event == "call":
                c = frame.f_code
                calls[f"{os.path.basename(c.co_filename)}:{c.co_name}"] += 1
            elif event == "c_call":
                calls[getattr(arg, "__qualname__", str(arg))] += 1

        batch(count)
        total = sum(calls.values())
        out = {
            "workload": w,
            "requests": n,
            "aten_ops": counts.ops,
            "syncs": syncs.n,
            "to_device": syncs.copies,
            "bytes_to_device": counts.bytes,
            "calls_per_request": round(total / n, 1),
            "ms_per_request_min": round(1e3 * times[0] / n, 4),
            "ms_per_request_med": round(1e3 * statistics.median(times) / n, 4),
            "batch_ms_min": round(1e3 * times[0], 2),
            # each phase's ms, lowest of the repeats: admissions, flush, make_plan, fill + upload
            "phase_ms_min": [round(1e3 * min(p[k] - (p[k - 1] if k else 0) for p in phases), 2) for k in range(4)],
            "digest_first": first,  # (the first batch's state, then a later one's)
            "digest": dig,
        }
        if TOP:
            out["top"] = calls.most_common(TOP)
        print(json.dumps(out), flush=True)


class Syncs(torch.utils._python_dispatch.TorchDispatchMode):
    """`_local_scalar_dense` (`.item()`, `.tolist()`) dispatched, and calls of `to_device`."""

    def __init__(self) -> None:
        super().__init__()
        self.n = self.copies = 0
        self._saved: list = []

    def __enter__(self):  # type: ignore[no-untyped-def]
        from vllm_worker.worker import actions, admission, graph_entries, graph_table

        for m in (admission, actions, graph_entries, graph_table, plan_mod):
            f = m.to_device
            self._saved.append((m, f))
            m.to_device = lambda t, d, f=f: self._copied() or f(t, d)  # type: ignore[attr-defined]
        return super().__enter__()

    def __exit__(self, *a):  # type: ignore[no-untyped-def]
        for m, f in self._saved:
            m.to_device = f  # type: ignore[attr-defined]
        return super().__exit__(*a)

    def _copied(self) -> None:
        self.copies += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


if __name__ == "__main__":
    main()
