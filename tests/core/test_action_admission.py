"""Probe actions admitted in one flush per step (`ActionTable.flush`) and a composition whose "token"
actions all fired skipping its steps (`action_step.settled`), on the table alone: the state each leaves
is the one the per-request / per-step path left, a slot taken again starts fresh, a wrong-width weight
row fails its own request, an unfired action keeps the composition folding."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from vllm_worker.protocol.wire import tensor_to_bytes
from vllm_worker.worker import action_step
from vllm_worker.worker.actions import EMA, TOKEN, ActionTable

D, SITE = 16, 5


@dataclass(eq=False)
class Req:
    acts: list = field(default_factory=list)


def _action(w: torch.Tensor, thr: float, kind: int = TOKEN, param: float = 0.0, lo: int = -1, hi: int = -1) -> dict:
    return {
        "name": "a",
        "sites": [SITE],
        "w": tensor_to_bytes(w.reshape(1, -1)),
        "b": 0.5,
        "threshold": thr,
        "kind": kind,
        "param": param,
        "stop": False,
        "ranges": [[lo, hi]],
    }


def _make(table: ActionTable, reqs: list[Req]) -> action_step.ActionStep:
    items = [(r, i, i + 1) for i, r in enumerate(reqs)]
    rows = np.arange(len(reqs), dtype=np.int64)
    return action_step.make(table, {SITE: (rows.copy(), rows, items)}, graph=True)


def _observe(table: ActionTable, step: action_step.ActionStep, x: torch.Tensor, pos: int) -> bool:
    """One step as `runtime._observe` runs it; False when the composition was settled (nothing done)."""
    if action_step.settled(step):
        return False
    n = x.shape[0]
    action_step.observe(table, step, action_step.graph_rows(step, x, 0), torch.full((n,), pos), None)
    return True


def test_flush_writes_every_slot_of_the_step_with_fresh_state():
    g = torch.Generator().manual_seed(0)
    table = ActionTable(D, torch.device("cpu"), n_slots=4)
    ws = [torch.randn(D, generator=g) for _ in range(3)]
    a = Req(table.uses("A", [_action(ws[0], 1e9, EMA, 0.25, lo=3, hi=9)], frozenset({SITE}), 10))
    assert float(table.W.abs().sum()) == 0.0  # nothing on the device before the step's flush
    table.flush()
    s = a.acts[0].slot
    assert torch.equal(table.W[a.acts[0].sites[SITE]], ws[0])
    assert (float(table.B[s]), float(table.thr[s]), float(table.param[s])) == (0.5, 1e9, 0.25)
    assert int(table.kind[s]) == EMA and (int(table.first[s, 0]), int(table.until[s, 0])) == (3, 9)
    # A's slot dirtied, then freed and taken again by B in one step with C: B starts fresh
    table.fired[s], table.gate[s], table.count[s], table.last_seen[s], table.fire_pos[s] = True, 1.0, 7, 40, 12
    table.free(a.acts)
    b = Req(table.uses("B", [_action(ws[1], -1e9)], frozenset({SITE}), 10))
    c = Req(table.uses("C", [_action(ws[2], 1e9, lo=2, hi=-1)], frozenset({SITE}), 10))
    table.flush()
    sb, sc = b.acts[0].slot, c.acts[0].slot
    assert sb == s
    assert not bool(table.fired[sb]) and float(table.gate[sb]) == 0.0 and int(table.count[sb]) == 0
    assert int(table.last_seen[sb]) == -1 and int(table.fire_pos[sb]) == -1 and int(table.kind[sb]) == TOKEN
    assert torch.equal(table.W[b.acts[0].sites[SITE]], ws[1]) and torch.equal(table.W[c.acts[0].sites[SITE]], ws[2])
    assert int(table.first[sb, 0]) == 10 and int(table.until[sc, 0]) == 1 << 62 and int(table.first[sc, 0]) == 2


def test_a_wrong_width_weight_fails_its_request_not_the_flush():
    table = ActionTable(D, torch.device("cpu"), n_slots=4)
    ok = Req(table.uses("A", [_action(torch.ones(D), -1e9)], frozenset({SITE}), 10))
    with pytest.raises(ValueError, match=r"probe_actions\[1\]\.w"):  # (read before its action 0 takes a slot)
        table.uses("B", [_action(torch.ones(D), -1e9), _action(torch.ones(D + 1), -1e9)], frozenset({SITE}), 10)
    table.drop("B")
    assert table.status()["action_slots"] == 1  # (B took no slot)
    table.flush()
    assert torch.equal(table.W[ok.acts[0].sites[SITE]], torch.ones(D))


def test_token_actions_all_fired_settle_and_an_unfired_one_keeps_folding():
    g = torch.Generator().manual_seed(1)
    table = ActionTable(D, torch.device("cpu"), n_slots=8)
    w = torch.randn(D, generator=g)
    x = torch.randn(2, D, generator=g)
    fire = [Req(table.uses(f"F{i}", [_action(w, -1e9)], frozenset({SITE}), 10)) for i in range(2)]
    step = _make(table, fire)
    assert _observe(table, step, x, 10)
    before = table.outcome(fire[0].acts + fire[1].acts)
    assert all(o["fired"] and o["position"] == 10 for o in before)
    assert not _observe(table, step, x, 11) and not _observe(table, step, x, 12)  # settled: nothing runs
    assert table.outcome(fire[0].acts + fire[1].acts) == before
    # with an action that never fires in the composition, every step folds (its last_seen moves)
    never = Req(table.uses("N", [_action(w, 1e9)], frozenset({SITE}), 10))
    step2 = _make(table, [fire[0], never])
    for p in (13, 14, 15):
        assert _observe(table, step2, x, p)
    assert int(table.last_seen[never.acts[0].slot]) == 15 and not table.outcome(never.acts)[0]["fired"]
    # EMA actions never settle (their running aggregate keeps folding)
    ema = Req(table.uses("E", [_action(w, -1e9, EMA, 0.5)], frozenset({SITE}), 10))
    step3 = _make(table, [ema])
    for p in (16, 17):
        assert _observe(table, step3, x[:1], p)
    assert int(table.count[ema.acts[0].slot]) == 2
