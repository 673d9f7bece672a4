"""What the probe actions' per-step bookkeeping costs on the host: a CPU micro-benchmark without an engine.

    PYTHONPATH=. .venv/bin/python bench/probes/action_step_cost.py [--n 256] [--d 128] [--steps 200]

W11's shape: `--n` decoding requests (one row each), each with one action at one site whose `then: steer`
gates one graph-path steering entry. A step is what `runtime._observe` does after a graph-path forward:
the site's staged rows read from the ring, scored, folded into the aggregates, the entries' gates set.
With a small `--d` the device work (torch on the CPU) is small, so what is measured is mostly host time:
`step_us` (wall per step once the actions fired, as W11's do at once; `watch_*`: the same for actions
that never fire), `py_calls` (Python function calls per step, cProfile: load-independent),
`aten_ops` (aten ops dispatched per step: on a GPU about one launch each), `make_ms` / `make_ops` (the
once-per-composition index build, `action_step.make`) and `admit_ms` / `uses_ops` + `flush_ops` (admitting the `--n`
requests' action slots: `ActionTable.uses` each, then the step's `flush`); `trickle8_ms` / `trickle8_ops`:
the requests arriving over 8 compositions, a step each, then a decode step of them all (`trickle`);
`leave_ms` / `leave_ops`: after they fired, the requests leaving two a step (a new composition each: W11's
end), every step as `runtime._observe` runs it (`leave`).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

from vllm_worker.protocol.wire import tensor_to_bytes  # noqa: E402
from vllm_worker.worker import action_step  # noqa: E402
from vllm_worker.worker.actions import ActionTable  # noqa: E402

SITE = 7


@dataclass(eq=False)
class Req:  # the part of `plan.RequestState` the actions read
    acts: list = field(default_factory=list)


class CountOps(TorchDispatchMode):
    """Counts the aten ops a step dispatches (on a GPU: about one kernel launch each)."""

    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.n += 1
        return func(*args, **(kwargs or {}))


def setup(n: int, d: int, threshold: float = -1e9) -> tuple[ActionTable, dict, torch.Tensor, torch.Tensor]:
    table = ActionTable(d, torch.device("cpu"))
    w = tensor_to_bytes(torch.randn(1, d))
    action = {
        "name": "m1",
        "sites": [SITE],
        "w": w,
        "b": 0.0,
        "threshold": threshold,
        "kind": 0,
        "param": 0.0,
        "stop": False,
        "ranges": [[-1, -1]],
    }
    items = []
    for i in range(n):
        r = Req(table.uses(f"r{i}", [action], frozenset({SITE}), 10))
        r.acts[0].entries = [i]
        items.append((r, i, i + 1))
    getattr(table, "flush", lambda: None)()  # (the step's admissions reach the device: `Admission.flush`)
    rows = np.arange(n, dtype=np.int64)
    per_site = {SITE: (rows.copy(), rows, items)}  # stage offsets = rows: the ring holds only these
    return table, per_site, torch.randn(n, d), torch.zeros(4 * n)


def admit(n: int, d: int) -> tuple[float, int, int]:
    """Admitting `n` requests' actions as a step's admissions do (`uses` each, then the table's one
    `flush`, where it has one): wall ms, aten ops in `uses` and in `flush` (on a GPU the ops on the
    table's buffers are launches; those decoding a request's weights run on host tensors)."""
    setup(n, d)  # (warm-up)
    t = time.perf_counter()
    setup(n, d)
    ms = (time.perf_counter() - t) * 1e3
    flush = getattr(ActionTable, "flush", None)
    if flush is not None:  # (`setup` flushes: count the two apart)
        ActionTable.flush = lambda self: None  # type: ignore[method-assign]
    with CountOps() as ops:
        table, *_ = setup(n, d)
    with CountOps() as fops:
        if flush is not None:
            flush(table)
    if flush is not None:
        ActionTable.flush = flush  # type: ignore[method-assign]
    return ms, ops.n, fops.n


def _observe(table: Any, step: Any, stage: Any, gate: Any, m: int, k: int) -> None:
    """One step's observation of `m` requests at position 20 + k, as `runtime._observe` runs it after a
    graph-path forward (nothing once the step's actions are settled)."""
    if _settled(step, table):
        return
    pos = np.full(m, 20 + k, dtype=np.int64)
    xs = action_step.graph_rows(step, stage, 0)
    positions = action_step.device_positions(torch.from_numpy(pos), pos, table.device)
    action_step.observe(table, step, xs, positions, gate)


def steady(n: int, d: int, steps: int, threshold: float) -> tuple[float, float, int, float, int]:
    """A step as `runtime._observe` runs it after a graph-path forward, `steps` times: (step_us, py_calls,
    aten_ops, make_ms, make_ops). threshold -1e9: every action fires on the first step (W11); 1e9: none ever
    does (the per-step cost of watching)."""
    table, per_site, stage, gate = setup(n, d, threshold)
    t = time.perf_counter()
    with CountOps() as make_ops:
        step = action_step.make(table, per_site, graph=True)
    make_ms = (time.perf_counter() - t) * 1e3

    def one(k: int) -> None:
        _observe(table, step, stage, gate, n, k)

    for k in range(5):
        one(k)
    t = time.perf_counter()
    for k in range(steps):
        one(5 + k)
    step_us = (time.perf_counter() - t) / steps * 1e6
    prof = cProfile.Profile()
    prof.enable()
    for k in range(20):
        one(5 + steps + k)
    prof.disable()
    calls = pstats.Stats(prof).total_calls / 20  # type: ignore[attr-defined]
    with CountOps() as ops:
        one(25 + steps)
    fired = threshold < 0
    assert bool(table.fired[:n].all()) == fired and (float(gate[:n].min()) == 1.0) == fired, "fired?"
    return step_us, calls, ops.n, make_ms, make_ops.n


def trickle(n: int, d: int, waves: int) -> tuple[float, int]:
    """Requests arriving over `waves` compositions (each: every request so far; W11's requests reach the
    engine over several steps), their actions firing at once: a step of each composition as
    `runtime._observe` runs it (`current`, which makes its indices, then `observe` unless settled), then a
    decode step of them all: total wall ms and aten ops."""
    table, per_site, stage, gate = setup(n, d)
    rows, _, items = per_site[SITE]
    plans = [
        SimpleNamespace(act_step=None, graph=SimpleNamespace(act={SITE: (rows[:m], rows[:m], items[:m])}))
        for m in [n * (w + 1) // waves for w in range(waves)] + [n]
    ]
    t = time.perf_counter()
    with CountOps() as ops:
        for k, plan in enumerate(plans):
            for j in range(1):
                step = action_step.current(table, plan)
                if _settled(step, table):
                    continue
                pos = np.full(len(plan.graph.act[SITE][1]), 20 + 2 * k + j, dtype=np.int64)
                xs = action_step.graph_rows(step, stage, 0)
                positions = action_step.device_positions(torch.from_numpy(pos), pos, table.device)
                action_step.observe(table, step, xs, positions, gate)
    ms = (time.perf_counter() - t) * 1e3
    assert bool(table.fired[:n].all()) and float(gate[:n].min()) == 1.0, "fired?"
    return ms, ops.n


def _settled(step: object, table: ActionTable) -> bool:
    try:  # (the table counts final actions: `ActionTable.finalize`; older code took the step alone)
        return action_step.settled(step, table)  # type: ignore[call-arg,arg-type]
    except TypeError:
        return action_step.settled(step)  # type: ignore[arg-type]


def leave(n: int, d: int) -> tuple[float, int]:
    """The `n` requests' actions fire, then they leave two a step (each step a new composition, a slot freed
    since the last): total wall ms and aten ops of those steps as `runtime._observe` runs them."""
    table, per_site, stage, gate = setup(n, d)
    rows, _, items = per_site[SITE]

    def one(m: int, k: int) -> None:
        plan = SimpleNamespace(act_step=None, graph=SimpleNamespace(act={SITE: (rows[:m], rows[:m], items[:m])}))
        _observe(table, action_step.current(table, plan), stage, gate, m, k)

    plan = SimpleNamespace(act_step=None, graph=SimpleNamespace(act={SITE: (rows, rows, items)}))
    for k in range(3):  # (fire, then learn it)
        step = action_step.current(table, plan)
        if not _settled(step, table):
            pos = np.full(n, 20 + k, dtype=np.int64)
            xs = action_step.graph_rows(step, stage, 0)
            action_step.observe(table, step, xs, torch.from_numpy(pos), gate)
    t = time.perf_counter()
    with CountOps() as ops:
        for k, m in enumerate(range(n - 2, 0, -2)):
            table.free(items[m][0].acts + items[m + 1][0].acts)
            one(m, 3 + k)
    return (time.perf_counter() - t) * 1e3, ops.n


def run(n: int, d: int, steps: int) -> dict:
    admit_ms, uses_ops, flush_ops = admit(n, d)
    step_us, calls, aten_ops, make_ms, make_ops = steady(n, d, steps, -1e9)
    watch_us, watch_calls, watch_ops, _, _ = steady(n, d, steps, 1e9)
    trickle(n, d, 8)  # (warm-up)
    trickle_ms, trickle_ops = trickle(n, d, 8)
    leave(n, d)  # (warm-up)
    leave_ms, leave_ops = leave(n, d)
    return {
        "n": n,
        "d": d,
        "steps": steps,
        "step_us": round(step_us, 1),
        "py_calls": calls,
        "aten_ops": aten_ops,
        "make_ms": round(make_ms, 2),
        "make_ops": make_ops,
        "watch_step_us": round(watch_us, 1),
        "watch_py_calls": watch_calls,
        "watch_aten_ops": watch_ops,
        "trickle8_ms": round(trickle_ms, 2),
        "trickle8_ops": trickle_ops,
        "leave_ms": round(leave_ms, 2),
        "leave_ops": leave_ops,
        "admit_ms": round(admit_ms, 2),
        "uses_ops": uses_ops,
        "flush_ops": flush_ops,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(run(a.n, a.d, a.steps)))


if __name__ == "__main__":
    main()
