"""What equal probe-action requests share at admission, and what a composition of fired actions skips:
weight rows decoded once per byte string (`ActionTable._weights`), rows that are one host row sent to the
device once (`device_copy.distinct_rows`, in `ActionTable.flush` and `SteeringEntries.flush`), and no index
build once every live action is final (`ActionTable.open`, `action_step.current`). Each table is compared
buffer by buffer with one filled without the sharing: the device state must be byte for byte the same."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_worker.protocol.wire import tensor_to_bytes
from vllm_worker.worker import action_step, actions, graph_entries
from vllm_worker.worker.actions import EMA, TOKEN, ActionTable
from vllm_worker.worker.device_copy import distinct_rows

D, SITE, SITE2 = 64, 5, 9
BUFFERS = ("W", "B", "thr", "kind", "sigmoid", "param", "count", "ema", "fired", "fire_pos", "gate", "first", "until")


@dataclass(eq=False)
class Req:
    acts: list = field(default_factory=list)


def _action(w: torch.Tensor, thr: float, sites: tuple = (SITE,), kind: int = TOKEN, lo: int = -1) -> dict:
    """A fresh payload dict (its own bytes object, as each request's decoded payload has)."""
    return {
        "name": "a",
        "sites": list(sites),
        "w": tensor_to_bytes(w.reshape(len(sites), -1)),
        "b": 0.25,
        "threshold": thr,
        "kind": kind,
        "param": 0.5,
        "stop": False,
        "ranges": [[lo, -1]],
    }


def _admit(table: ActionTable, ws: list[torch.Tensor]) -> dict[str, list]:
    """A step's admissions: five requests of one probe, two of another, a two-layer probe, one whose bytes
    differ from the first probe's only inside (same first and last 64 bytes), an EMA action; one request
    leaves and its slot is taken again in the same step."""
    local = frozenset({SITE, SITE2})
    mid = ws[0].clone()
    mid[D // 2] += 1.0
    plan = [("p0", ws[0], (SITE,))] * 5 + [("p1", ws[1], (SITE,))] * 2 + [("two", ws[2], (SITE, SITE2))]
    plan += [("mid", mid, (SITE,)), ("ema", ws[0], (SITE,))]
    out: dict[str, list] = {}
    for i, (name, w, sites) in enumerate(plan):
        out[f"{name}{i}"] = table.uses(
            f"{name}{i}", [_action(w, 1e9, sites, EMA if name == "ema" else TOKEN)], local, 7
        )
    table.free(out.pop("p01"))
    out["again"] = table.uses("again", [_action(ws[0], -1e9, lo=3)], local, 7)
    return out


def test_equal_weights_are_decoded_once_and_the_table_is_what_per_request_copies_give(monkeypatch):
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(D, generator=g), torch.randn(D, generator=g), torch.randn(2 * D, generator=g)]
    shared = ActionTable(D, torch.device("cpu"), n_slots=16)
    got = _admit(shared, ws)
    rows = list(shared._new_w.values())
    # p0's (p0..., then ema and again: decoded anew after mid took its place in the memo), p1, two's two
    # rows, mid: 6 distinct of 11 rows
    assert len(distinct_rows(rows)[0]) == 6
    assert rows[0] is not rows[2] and rows[0].data_ptr() == rows[2].data_ptr()  # (one decoded tensor)
    kept = rows[0].clone()
    shared.flush()
    monkeypatch.setattr(actions, "WEIGHTS_KEPT", 0)  # nothing remembered: each request decodes its own
    alone = ActionTable(D, torch.device("cpu"), n_slots=16)
    want = _admit(alone, ws)
    assert len(distinct_rows(list(alone._new_w.values()))[0]) == 11
    alone.flush()
    for name in BUFFERS:
        assert torch.equal(getattr(shared, name), getattr(alone, name)), name
    assert [[u.slot for u in v] for v in got.values()] == [[u.slot for u in v] for v in want.values()]
    for v in got.values():  # every request's weight rows as it sent them
        for u in v:
            for s, r in u.sites.items():
                assert torch.equal(shared.W[r], alone.W[r])
    mid = got["mid8"][0].sites[SITE]
    assert not torch.equal(shared.W[mid], shared.W[got["p00"][0].sites[SITE]])  # (same edges, other bytes)
    assert torch.equal(rows[0], kept)  # the remembered tensor was never written


def test_a_wrong_width_weight_fails_every_request_sending_it():
    table = ActionTable(D, torch.device("cpu"), n_slots=4)
    bad = torch.ones(D + 4)
    for i in range(2):  # (the second one finds the decoded bytes remembered: checked all the same)
        with pytest.raises(ValueError, match=r"probe_actions\[0\]\.w: 68 columns"):
            table.uses(f"r{i}", [_action(bad, 1.0)], frozenset({SITE}), 7)
        table.drop(f"r{i}")
    assert table.status()["action_slots"] == 0 and table.open == 0


def test_distinct_rows_merges_only_rows_that_are_one_in_memory():
    base = torch.arange(12.0).reshape(3, 4)
    t = base.t()  # (a row of the transpose starts where a row of `base` does, with another stride)
    rows = [base[0], base[1], base[0], t[0], base[1].clone(), base.view(3, 4)[1]]
    out, which = distinct_rows(rows)
    assert which == [0, 1, 0, 2, 3, 1] and len(out) == 4
    assert all(torch.equal(out[j], r) for r, j in zip(rows, which))


def test_entry_rows_remembered_by_content_reach_the_table_as_copies_would(monkeypatch):
    g = torch.Generator().manual_seed(3)
    v, u = torch.randn(D, generator=g), torch.randn(D, generator=g)

    def fill() -> graph_entries.SteeringEntries:
        table = graph_entries.SteeringEntries(32, D, torch.bfloat16, torch.device("cpu"))
        for i in range(6):  # gated chains (a probe action's: never shared), equal contents but one
            a = (u if i == 4 else v).clone()
            steps = [(0, a, torch.zeros(D), -1.0, 1.0)]
            assert table.add_chains([(("k", i == 4), steps)], gated=True) is not None
        table.flush()
        return table

    shared = fill()
    monkeypatch.setattr(graph_entries, "ROWS_KEPT", 0)  # nothing remembered: every request's own rows
    alone = fill()
    for name in ("A", "B", "bflag", "op", "nxt", "lo", "hi", "gate"):
        assert torch.equal(getattr(shared, name), getattr(alone, name)), name
    assert not torch.equal(shared.A[0], shared.A[4]) and torch.equal(shared.A[0], shared.A[5])


def _observe(table: ActionTable, plan: SimpleNamespace, x: torch.Tensor, pos: int) -> bool:
    """One step as `runtime._observe` runs it; False when nothing was done."""
    step = action_step.current(table, plan)
    if action_step.settled(step, table):
        return False
    n = len(plan.graph.act[SITE][1])
    action_step.observe(table, step, action_step.graph_rows(step, x, 0), torch.full((n,), pos), None)
    return True


def _plan(reqs: list[Req]) -> SimpleNamespace:
    rows = np.arange(len(reqs), dtype=np.int64)
    items = [(r, i, i + 1) for i, r in enumerate(reqs)]
    return SimpleNamespace(act_step=None, graph=SimpleNamespace(act={SITE: (rows.copy(), rows, items)}))


def test_once_every_live_action_is_final_compositions_are_settled_without_an_index_build(monkeypatch):
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(D, generator=g), torch.randn(8, D, generator=g)
    table = ActionTable(D, torch.device("cpu"), n_slots=16)
    reqs = [Req(table.uses(f"r{i}", [_action(w, -1e9)], frozenset({SITE}), 7)) for i in range(4)]
    table.flush()
    assert table.open == 4
    plan = _plan(reqs)
    assert _observe(table, plan, x, 7)  # fires every action
    before = table.outcome([u for r in reqs for u in r.acts])
    assert not _observe(table, plan, x, 8)  # learnt: all final
    assert table.open == 0

    def no_build(*a: object, **k: object) -> None:
        raise AssertionError("an index build for a composition of final actions")

    monkeypatch.setattr(action_step, "make", no_build)
    table.free(reqs[3].acts)  # a request leaves: a new composition, no build, nothing folds
    assert not _observe(table, _plan(reqs[:3]), x, 9)
    assert table.outcome([u for r in reqs[:3] for u in r.acts]) == before[:3]
    monkeypatch.undo()
    late = Req(table.uses("late", [_action(w, 1e9)], frozenset({SITE}), 7))  # never fires: keeps folding
    table.flush()
    assert table.open == 1
    plan = _plan(reqs[:3] + [late])
    for p in (10, 11):
        assert _observe(table, plan, x, p)
    assert int(table.last_seen[late.acts[0].slot]) == 11 and table.outcome(reqs[0].acts) == before[:1]
    table.free(late.acts)  # freed before it fired: counted once
    table.free(late.acts)
    for r in reqs[:3]:
        table.free(r.acts)
    assert table.open == 0 and table.status()["action_slots"] == 0


def test_the_outcomes_of_requests_leaving_together_are_read_at_once_and_equal_each_read_alone(monkeypatch):
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(D, generator=g), torch.randn(8, D, generator=g)
    table = ActionTable(D, torch.device("cpu"), n_slots=16)
    thresholds = [-1e9, 1e9, float(x[2] @ w) + 0.25 - 1e-3, -1e9]  # fires, never, fires at row 2's score, fires
    reqs = [Req(table.uses(f"r{i}", [_action(w, t)], frozenset({SITE}), 7)) for i, t in enumerate(thresholds)]
    two = Req(table.uses("two", [_action(w, -1e9), _action(w, 1e9, lo=40)], frozenset({SITE}), 7))
    table.flush()
    plan = _plan(reqs + [two])
    for p in (7, 8, 9):
        _observe(table, plan, x, p)
    groups = [r.acts for r in reqs + [two]] + [[]]
    alone = [table.outcome(g) for g in groups]
    assert alone[0][0]["fired"] and not alone[1][0]["fired"] and alone[1][0]["value"] is None
    assert alone[4][0]["position"] == 7 and alone[4][0]["token_index"] == 0 and not alone[4][1]["fired"]
    assert alone[2][0]["value"] == float(table.fire_value[reqs[2].acts[0].slot])  # (a float32 value, exactly)
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))
    assert table.outcomes(groups) == alone
    assert len(reads) == 1  # (on a GPU each read waits for the device)


def test_a_fetch_reads_its_live_requests_outcomes_at_once_each_as_read_alone(monkeypatch):
    """Requests fetched before they leave the batch (the run's last step: no step after it prunes them) hold
    `OutcomeLater`; `read_together` reads them in one device read, each equal to its own read, and a failing
    read leaves them to be read one by one (where a failure is that request's own error)."""
    g = torch.Generator().manual_seed(6)
    w, x = torch.randn(D, generator=g), torch.randn(8, D, generator=g)
    table = ActionTable(D, torch.device("cpu"), n_slots=16)
    reqs = [Req(table.uses(f"r{i}", [_action(w, t)], frozenset({SITE}), 7)) for i, t in enumerate((-1e9, 1e9, -1e9))]
    table.flush()
    plan = _plan(reqs)
    for p in (7, 8):
        _observe(table, plan, x, p)
    alone = [table.outcome(r.acts) for r in reqs]
    stores = [SimpleNamespace(actions=actions.OutcomeLater(table, r.acts)) for r in reqs]
    stores.append(SimpleNamespace(actions=[{"already": "read"}]))  # (read when it left: kept as it is)
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))
    actions.read_together(stores)
    assert len(reads) == 1
    assert [st.actions for st in stores] == [*alone, [{"already": "read"}]]

    later = [SimpleNamespace(actions=actions.OutcomeLater(table, r.acts)) for r in reqs]
    monkeypatch.setattr(table, "outcomes", lambda groups: (_ for _ in ()).throw(RuntimeError("read failed")))
    actions.read_together(later)
    assert all(type(st.actions) is actions.OutcomeLater for st in later)  # still to read, one by one
    monkeypatch.undo()
    assert [st.actions() for st in later] == alone
