"""A template's probe actions prepared once (`ActionTable.prepare` / `uses_prepared`): a batch admitted
from templates must leave the action table (buffers, slot and row free lists, queued constants, live
count), every request's uses and its gated steering entries exactly what per-request admission
(`Templates.kept = 0`) leaves, with mixed actions (watched ranges open and fixed, several actions and
layers, aggregates, stops), per-request prompt lengths, a request whose weights are malformed, and a table
that fills up midway."""

from __future__ import annotations

import types

import torch

from tests.unit.test_admit_templates import ACTION_BUFFERS, ENTRY_BUFFERS, LAYERS, SITES, D
from vllm_worker.api.steering import SteeringVector
from vllm_worker.frontend.validation import parse_request
from vllm_worker.protocol.spec import ModelShape, encode
from vllm_worker.worker import graph
from vllm_worker.worker.actions import ActionTable
from vllm_worker.worker.admission import Admission
from vllm_worker.worker.store import CaptureStore

N = 40


class Runner:
    def __init__(self, n: int) -> None:  # (prompt lengths differ: an open range starts at each one's own)
        self.requests = {f"r{i}": types.SimpleNamespace(num_prompt_tokens=5 + i % 3) for i in range(n)}


def _make(kept: int, slots: int) -> Admission:
    g = graph.GraphTaps(SITES, D, torch.bfloat16, torch.device("cpu"), 64, None)
    store = CaptureStore(torch.device("cpu"))
    args = (Runner(N), torch.device("cpu"), torch.bfloat16, D, frozenset(SITES), frozenset(range(LAYERS)), {}, True)
    table = ActionTable(D, torch.device("cpu"), n_slots=slots)
    adm = Admission(*args, None, store, g, None, None, actions=table)  # type: ignore[arg-type]
    adm.templates.kept = kept
    return adm


def _payloads() -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    u, u2 = (torch.nn.functional.normalize(torch.randn(D, generator=gen), dim=0) for _ in range(2))
    shape = ModelShape(n_layers=LAYERS, d_model=D)

    def act(u_: torch.Tensor, layer: int, **kw) -> dict:
        return {"direction": u_.tolist(), "layer": layer, "threshold": -1e9, **kw}

    def steer(scale: float) -> dict:
        return {"steer": SteeringVector(activations=u2.view(1, D).clone(), layer_indices=[2], scale=scale)}

    kinds = [
        [act(u, 1, then=steer(1.0))],  # (W11: generated positions, an open range)
        [act(u, 1, then=steer(2.0), positions="all", aggregate="ema:0.5")],
        [act(u, 0, then="stop", positions=[2, {"start": 4, "end": 9}]), act(u2, 1, then=steer(1.0))],
        [act(u2, 3, then=steer(-1.0), positions=[{"start": 1}, 3], aggregate="rolling_max:4")],
        [act(u, 1, then="stop")],
    ]
    out = []
    for i in range(N):
        spec = parse_request({"probe_actions": kinds[i % len(kinds)]}, shape, 7)
        assert spec is not None
        out.append(encode(spec))
        if i % len(kinds) == 1:  # (a probe on two layers, as a loaded multi-layer probe sends: two rows)
            a = out[-1]["actions"][0]
            a["sites"] = [SITES[1], SITES[3]]
            a["w"] = {**a["w"], "shape": [2, D], "data": a["w"]["data"] + (-u2).numpy().tobytes()}
    bad = encode(parse_request({"probe_actions": kinds[0]}, shape, 7))
    bad["actions"][0]["w"]["shape"] = [1, D // 2]  # (a width that is not the model's: this request fails)
    out.insert(7, bad)
    out.insert(13, encode(parse_request({"probe_actions": kinds[0]}, shape, 7)))  # (same as 7 but good)
    out.insert(14, dict(bad))
    return out[:N]


def _state(adm: Admission, s) -> dict:
    acts = [
        (u.index, u.name, u.req_id, dict(u.sites), u.slot, u.stop, u.first_watched, u.every_row, u.rows)
        + (u.kind, u.sigmoid, u.entries, u.freed, u.final)
        for u in s.acts
    ]
    entries = None if s.entries is None else {k: (v[0], v[3], v[4]) for k, v in sorted(s.entries.items())}
    err = None if s.store is None or s.store.error is None else (s.store.error["kind"], s.store.error["message"])
    gates = [None if st.gate is None else st.gate.data_ptr() - adm.actions.gate.data_ptr() for st in s.steers]
    return {"acts": acts, "entries": entries, "ids": list(s.entry_ids), "error": err, "gates": gates}


def _table(adm: Admission) -> dict:
    t, a = adm.graph.entries, adm.actions
    out: dict = {name: getattr(t, name).clone() for name in ENTRY_BUFFERS}
    out.update({"act_" + name: getattr(a, name).clone() for name in ACTION_BUFFERS})
    out.update(refs=list(t._refs), free=list(t._free), slots=list(a._free), rows=list(a._wfree), open=a.open)
    out.update(
        by_req=sorted(a._by_req),
        queued=({k: (f, list(i)) for k, (f, i) in a._new.items()}, {r: w.tolist() for r, w in a._new_w.items()}),
    )
    return out


def _run(adm: Admission) -> tuple[list, list]:
    """Admit, record the queued constants (before `flush` takes them), flush; half leave and come back."""
    states = [adm.admit(f"r{i}", p) for i, p in enumerate(_payloads())]
    seen, tables = [[_state(adm, s) for s in states]], [_table(adm)]
    adm.flush()
    tables.append(_table(adm))
    for s in states[: N // 2]:
        adm.graph.free_entries(s.entry_ids)
        adm.actions.free(s.acts)
    again = [adm.admit(f"r{i}", p) for i, p in enumerate(_payloads()[: N // 2])]
    seen.append([_state(adm, s) for s in again])
    tables.append(_table(adm))
    adm.flush()
    tables.append(_table(adm))
    return seen, tables


def _same(a: dict, b: dict) -> None:
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_prepared_actions_equal_per_request_admission_bit_for_bit():
    for slots in (64, 16):  # (16: the table fills up midway; later requests are refused, as without templates)
        got_adm, want_adm = _make(8, slots), _make(0, slots)
        got, got_tables = _run(got_adm)
        want, want_tables = _run(want_adm)
        assert got == want
        for a, b in zip(got_tables, want_tables):
            _same(a, b)
        assert got_adm.templates.hits > N // 2 and want_adm.templates.hits == 0
        prepared = [t.prepared for t in got_adm.templates._memo.values()]
        assert sum(bool(p) for p in prepared) >= 3  # (the prepared path was taken, stops aside)
        errors = [s["error"] for s in got[0]]
        assert errors[7] is not None and errors[14] is not None and errors[13] is None
        assert errors[7][0] == errors[14][0]  # (a malformed payload fails alike from a template)
        refused = [e for e in errors if e is not None and e[0] == "limit"]
        assert bool(refused) == (slots == 16)  # (table full: refused with its own kind)
        assert any(e is not None and e[0] == "unsupported" for e in errors)  # (stops: this runner has none)
        assert any(len(u[3]) == 2 for s in got[0] for u in s["acts"])  # (the two-layer probe was admitted)
        firsts = {u[6] for s in got[0] for u in s["acts"]}
        assert firsts == {4, 5, 6}  # (each request's own prompt end)


def test_prepared_rows_are_never_written_and_fit_the_table():
    adm = _make(8, 64)
    payloads = _payloads()
    for i, p in enumerate(payloads[:12]):
        adm.admit(f"r{i}", p)
    adm.flush()
    prep = next(t.prepared for t in adm.templates._memo.values() if t.prepared)
    before = [r.clone() for a in prep.acts for r in a[3]]
    adm.actions.W.add_(1.0)  # (a write to the table must not reach the template's rows)
    assert all(torch.equal(x, r) for x, r in zip(before, (r for a in prep.acts for r in a[3])))
    assert all(r.shape == (D,) for a in prep.acts for r in a[3])


def _doubly_bad() -> dict[str, list[dict]]:
    """Sequences whose requests are wrong twice over: a weight of the wrong width (or whose bytes do not
    match its shape) sent while the table is full (after it filled, and before), and a request whose second
    action has it, with room for its first action only and with room for both."""
    shape = ModelShape(n_layers=LAYERS, d_model=D)
    u = torch.nn.functional.normalize(torch.randn(D, generator=torch.Generator().manual_seed(3)), dim=0)

    def act(layer: int) -> dict:
        then = {"steer": SteeringVector(activations=u.view(1, D).clone(), layer_indices=[2], scale=1.0)}
        return {"direction": u.tolist(), "layer": layer, "threshold": -1e9, "then": then}

    def narrow(a: dict, bytes_too: bool) -> None:  # (half the model's width; `bytes_too`: data and shape agree)
        a["w"] = {**a["w"], "shape": [1, D // 2], "data": a["w"]["data"][: 2 * D] if bytes_too else a["w"]["data"]}

    good = encode(parse_request({"probe_actions": [act(1)]}, shape, 7))
    out = {}
    for bytes_too, what in ((True, "width"), (False, "bytes")):
        bad = encode(parse_request({"probe_actions": [act(1)]}, shape, 7))
        narrow(bad["actions"][0], bytes_too)
        two = encode(parse_request({"probe_actions": [act(1), act(2)]}, shape, 7))
        narrow(two["actions"][1], bytes_too)
        out[f"full, then wrong {what}"] = [good, good, bad, bad, bad]
        out[f"wrong {what}, then full"] = [bad, bad, good, good, bad, bad]
        out[f"second action's wrong {what}, room for one"] = [good, good, two, two, two]
        out[f"second action's wrong {what}, room for both"] = [two, two, two]
    return out


def test_a_doubly_bad_request_is_refused_alike_with_and_without_templates():
    """The table-full refusal comes before any action is read, on both paths (`prepare` does find the wrong
    width first, but only to leave the template unprepared: the request is then refused by `uses`); a
    refused request takes no slot, not even its good action's."""
    for name, seq in _doubly_bad().items():
        got = {}
        for kept in (8, 0):
            adm = _make(kept, 2)
            states, tables = [], []
            for i, p in enumerate(seq):
                before = _table(adm)
                states.append(_state(adm, adm.admit(f"r{i}", dict(p))))
                tables.append(_table(adm))
                if states[-1]["error"] is not None:  # (nothing taken, nothing queued)
                    _same(before, tables[-1])
            got[kept] = states, tables
        assert got[8][0] == got[0][0], name
        for a, b in zip(got[8][1], got[0][1]):
            _same(a, b)
        errors = [s["error"] for s in got[8][0]]
        full = "room for both" not in name
        want = [e for e in errors if e is not None]
        assert want and all(e[0] == "limit" for e in want[-2:]) == full, name
        told = "columns, the model's width is" if "width" in name else "bytes do not match"
        if "then full" in name:
            assert errors[0][0] == "internal" and "probe_actions[0].w" in errors[0][1] and told in errors[0][1]
        if "room for both" in name:
            assert all(e[0] == "internal" and "probe_actions[1].w" in e[1] and told in e[1] for e in errors)


def test_an_action_watching_no_range_or_too_many_is_refused_before_a_slot_is_taken():
    """(the frontend sends 1..MAX_RANGES: a payload it did not make must fail by the field, not leak the
    slot it took before `min()` / an index failed, as it did)"""
    from vllm_worker.worker.actions import MAX_RANGES

    shape = ModelShape(n_layers=LAYERS, d_model=D)
    u = torch.ones(D) / D**0.5
    then = {"steer": SteeringVector(activations=u.view(1, D).clone(), layer_indices=[2], scale=1.0)}
    act = {"direction": u.tolist(), "layer": 1, "threshold": 0.0, "then": then}
    base = encode(parse_request({"probe_actions": [act]}, shape, 7))
    for ranges in ([], [[k, k + 1] for k in range(MAX_RANGES + 1)]):
        p = {**base, "actions": [{**base["actions"][0], "ranges": ranges}]}
        for kept in (8, 0):
            adm = _make(kept, 4)
            before = _table(adm)
            errors = [_state(adm, adm.admit(f"r{i}", dict(p)))["error"] for i in range(3)]
            assert all(e is not None and "probe_actions[0].ranges" in e[1] for e in errors), errors
            _same(before, _table(adm))
            assert adm.actions.status()["action_slots"] == 0
