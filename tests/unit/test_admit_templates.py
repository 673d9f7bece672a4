"""Admission templates (`admit_templates`): a batch admitted with templates must leave every table and
every request's state byte for byte what admission without them leaves (`Templates.kept = 0`), with mixed
payloads, equal-but-separate byte strings, fields that compare equal in Python but differ in bits, a bad
request in the middle, and requests leaving and coming back (a stale shared record must never be used)."""

from __future__ import annotations

import math
import types

import numpy as np
import torch

from vllm_worker import counters
from vllm_worker.api.steering import SteeringVector
from vllm_worker.frontend.validation import parse_request
from vllm_worker.protocol.ops import ABLATE, CAP
from vllm_worker.protocol.points import OUT, site
from vllm_worker.protocol.spec import ModelShape, RequestSpec, Steer, encode
from vllm_worker.worker import graph
from vllm_worker.worker.actions import ActionTable
from vllm_worker.worker.admission import Admission
from vllm_worker.worker.store import CaptureStore

D, LAYERS = 64, 4
SITES = [site(l, OUT) for l in range(LAYERS)]
ENTRY_BUFFERS = ("A", "B", "bflag", "op", "nxt", "lo", "hi", "gate")
ACTION_BUFFERS = ("W", "B", "thr", "kind", "sigmoid", "param", "count", "fired", "gate", "first", "until")


class Runner:
    def __init__(self, n: int) -> None:
        self.requests = {f"r{i}": types.SimpleNamespace(num_prompt_tokens=7) for i in range(n)}


def _make(n: int, kept: int) -> Admission:
    g = graph.GraphTaps(SITES, D, torch.bfloat16, torch.device("cpu"), 64, None)
    store = CaptureStore(torch.device("cpu"))
    args = (Runner(n), torch.device("cpu"), torch.bfloat16, D, frozenset(SITES), frozenset(range(LAYERS)), {}, True)
    adm = Admission(*args, None, store, g, None, None, actions=ActionTable(D, torch.device("cpu"), n_slots=64))  # type: ignore[arg-type]
    adm.templates.kept = kept
    return adm


def _payloads() -> list[dict]:
    """Fresh payload dicts (each its own bytes objects, as decoded messages are): W12-, W13- and W11-like
    requests interleaved, a second W12 vector, -0.0 against 0.0, a memoryview's bytes, a bad request."""
    gen = torch.Generator().manual_seed(0)
    u = torch.nn.functional.normalize(torch.randn(D, generator=gen), dim=0)
    u2 = torch.nn.functional.normalize(torch.randn(D, generator=gen), dim=0)

    def ablate(i: int, v: torch.Tensor) -> dict:
        st = Steer(list(SITES), v.expand(LAYERS, D).clone(), None, 1.0, False, op=ABLATE)
        return encode(RequestSpec(key=f"k{i}", steers=[st]))

    def cap(i: int, lo: float) -> dict:
        st = Steer([SITES[1]], u.view(1, D).clone(), None, 1.0, False, op=CAP, lo=lo, hi=1.0)
        return encode(RequestSpec(key=f"k{i}", steers=[st]))

    def act(i: int) -> dict:
        steer = SteeringVector(activations=u2.view(1, D).clone(), layer_indices=[2], scale=1.0)
        a = {"direction": u.tolist(), "layer": 1, "threshold": -1e9, "then": {"steer": steer}}
        spec = parse_request({"probe_actions": [a]}, ModelShape(n_layers=LAYERS, d_model=D), 7)
        assert spec is not None
        return encode(spec)

    def plain(i: int, scale: float) -> dict:
        st = Steer([SITES[0], SITES[3]], u2.expand(2, D).clone(), None, scale, False)
        return encode(RequestSpec(key=f"k{i}", steers=[st]))

    out = []
    for i in range(24):
        kind = i % 6
        if kind == 0:
            out.append(ablate(i, u))
        elif kind == 1:
            out.append(cap(i, -1.0 if i % 4 else -0.0))  # (-0.0 == 0.0 in Python: different bits)
        elif kind == 2:
            out.append(act(i))
        elif kind == 3:
            out.append(ablate(i, u2 if i % 4 == 3 else u))
        elif kind == 4:
            out.append(plain(i, 0.0 if i % 8 == 4 else -0.0))
        else:
            p = ablate(i, u)
            vec = p["steer"][0]["vec"]
            vec["data"] = memoryview(bytearray(vec["data"]))  # (a view of a message, as over IPC)
            out.append(p)
    bad = ablate(99, u)
    bad["steer"][0]["vec"]["data"] = bad["steer"][0]["vec"]["data"][:-4]  # a byte short: this request fails
    out.insert(11, bad)
    return out


def _state(adm: Admission, s) -> dict:
    """What a request's state holds, comparable across two admissions (tensors by value)."""
    steers = [
        (
            dict(st.layers),
            st.vectors.float().tolist(),
            None if st.lut is None else st.lut.tolist(),
            (st.scale, math.copysign(1.0, st.scale)),  # (-0.0 == 0.0 in Python: the sign compared too)
            st.norm_match,
            st.op,
            st.lo,
            st.hi,
            st.digest,
            None if st.gate is None else (st.gate.data_ptr() - adm.actions.gate.data_ptr()),
        )
        for st in s.steers
    ]
    entries = None
    if s.entries is not None:
        entries = {k: (v[0], v[1].tolist(), v[2].tolist(), v[3], v[4]) for k, v in sorted(s.entries.items())}
    acts = [(u.slot, dict(u.sites), u.entries, u.first_watched) for u in s.acts]
    err = None if s.store is None or s.store.error is None else (s.store.error["kind"], s.store.error["message"])
    simple = {l: v.contiguous().view(torch.int16).reshape(-1).tolist() for l, v in sorted(s.simple_add.items())}
    return {
        "steers": steers,
        "simple": simple,
        "entries": entries,
        "ids": list(s.entry_ids),
        "acts": acts,
        "error": err,
    }


def _tables(adm: Admission) -> dict:
    t = adm.graph.entries
    out = {name: getattr(t, name).clone() for name in ENTRY_BUFFERS}
    out.update({"act_" + name: getattr(adm.actions, name).clone() for name in ACTION_BUFFERS})
    out["refs"] = list(t._refs)
    out["chains"] = sorted(map(repr, t._chains.values()))
    out["hits"] = t.shared_hits
    out["free"] = list(t._free)
    return out


def _same_tables(a: dict, b: dict) -> None:
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _run(adm: Admission, payloads: list[dict], rounds: int) -> tuple[list, list]:
    """Admit the batch, flush; then, `rounds` times, the first half (every other round: all) leaves and
    comes back with the same payloads (chains leave the table and are stored again); states and tables
    after each round."""
    states = [adm.admit(f"r{i}", p) for i, p in enumerate(payloads)]
    adm.flush()
    seen, tables = [[_state(adm, s) for s in states]], [_tables(adm)]
    for r in range(rounds):
        half = len(states) if r % 2 else len(states) // 2  # (every other round: all leave, chains too)
        for s in states[:half]:
            adm.graph.free_entries(s.entry_ids)
            adm.actions.free(s.acts)
        again = [adm.admit(f"r{i}", p) for i, p in enumerate(payloads[:half])]
        adm.flush()
        states = again + states[half:]
        seen.append([_state(adm, s) for s in states])
        tables.append(_tables(adm))
    return seen, tables


def test_a_template_admitted_batch_equals_per_request_admission_bit_for_bit():
    payloads = _payloads()
    with_t = _make(len(payloads), 8)
    without = _make(len(payloads), 0)
    got, got_tables = _run(with_t, payloads, 3)
    want, want_tables = _run(without, _payloads(), 3)
    assert got == want
    for a, b in zip(got_tables, want_tables):
        _same_tables(a, b)
    assert with_t.templates.hits > len(payloads) // 2  # (most requests came from a template)
    assert without.templates.hits == 0
    kept = list(with_t.templates._memo.values())
    assert any(t.shared for t in kept) and any(t.gated for t in kept)  # (both shortcuts were taken)
    bad = got[0][11]
    assert bad["error"] is not None and "steer.vec.data" in bad["error"][1]
    assert sum(s["error"] is not None for s in got[0]) == 1  # (the bad request fails alone)
    zero = [next(iter(s["simple"].values())) for i, s in enumerate(got[0]) if i < 11 and i % 6 == 4]
    assert zero[0] != zero[1] and {abs(x) for x in zero[0] + zero[1]} == {0, 1 << 15}  # (0.0 and -0.0 rows as sent)


def test_requests_of_one_template_share_nothing_they_may_write():
    payloads = _payloads()
    adm = _make(len(payloads), 8)
    before = dict(counters.STEP_TIMINGS)
    states = [adm.admit(f"r{i}", p) for i, p in enumerate(payloads)]
    adm.flush()
    adm.flush()  # (no admission since: not a step that admitted)
    assert counters.STEP_TIMINGS["admit_steps"] - before["admit_steps"] == 1
    assert counters.STEP_TIMINGS["admitted"] - before["admitted"] == len(payloads)
    a, b = states[0], states[3]  # (two W12-like requests of one vector)
    assert a.steers[0] is not b.steers[0] and a.steers[0].layers is not b.steers[0].layers
    assert a.entry_ids is not b.entry_ids
    adm.flush()
    a.steers[0].layers.clear()  # (a request's own objects: another's are untouched)
    assert b.steers[0].layers
    for t in adm.templates._memo.values():  # (copies of the bytes, never a view of a message)
        assert all(isinstance(x, bytes) for x in t.blobs)
    mv = payloads[5]["steer"][0]["vec"]["data"]
    assert isinstance(mv, memoryview)
    mv[0] ^= 0xFF  # (the message changes after admission: no template or state follows it)
    again = adm.admit("r5", payloads[5])
    assert again.steers[0].digest != states[5].steers[0].digest
    assert np.array_equal(states[5].steers[0].vectors.float().numpy(), states[0].steers[0].vectors.float().numpy())


def test_requests_alternating_between_two_vectors_each_reuse_their_own_template():
    """Two contents with equal fields, interleaved (a batch steering with +v and -v): each keeps its
    template. Keyed by the fields alone, each replaced the other's and every request made a new template
    (more work than no template: 38 made, no hit, for these 40 requests)."""
    gen = torch.Generator().manual_seed(1)
    units = [torch.nn.functional.normalize(torch.randn(D, generator=gen), dim=0) for _ in range(2)]

    def payloads() -> list[dict]:
        out = []
        for i in range(40):
            st = Steer(list(SITES), units[i % 2].expand(LAYERS, D).clone(), None, 1.0, False, op=ABLATE)
            out.append(encode(RequestSpec(key=f"k{i}", steers=[st])))
        return out

    with_t, without = _make(40, 8), _make(40, 0)
    got, got_tables = _run(with_t, payloads(), 2)
    want, want_tables = _run(without, payloads(), 2)
    assert got == want
    for a, b in zip(got_tables, want_tables):
        _same_tables(a, b)
    assert len(with_t.templates._memo) == 2
    assert with_t.templates.hits == 40 + 20 + 40 - 4  # (all but each content's first two: seen, then made)


def test_a_request_failing_after_sharing_a_templates_entries_gives_its_counts_back():
    """A request admitted from a template's shared entries that then fails (here: moving its vectors) gives
    back exactly the counts it took: the tables, refcounts and later requests equal per-request admission."""
    gen = torch.Generator().manual_seed(2)
    u = torch.nn.functional.normalize(torch.randn(D, generator=gen), dim=0)

    def payloads() -> list[dict]:
        return [
            encode(
                RequestSpec(
                    key=f"k{i}", steers=[Steer(list(SITES), u.expand(LAYERS, D).clone(), None, 1.0, False, op=ABLATE)]
                )
            )
            for i in range(8)
        ]

    def run(adm: Admission) -> tuple[list, list]:
        real, calls = adm._move_vectors, [0]
        adm.states = []  # type: ignore[attr-defined]

        def move(st):  # (the fifth request's move fails, after its entries were taken)
            calls[0] += 1
            if calls[0] == 5:
                raise RuntimeError("injected")
            real(st)

        adm._move_vectors = move  # type: ignore[method-assign]
        admit = adm.admit

        def kept(req_id: str, p: dict):
            s = admit(req_id, p)
            adm.states.append(s)  # type: ignore[attr-defined]
            return s

        adm.admit = kept  # type: ignore[method-assign]
        return _run(adm, payloads(), 2)

    with_t, without = _make(8, 8), _make(8, 0)
    got, got_tables = run(with_t)
    want, want_tables = run(without)
    assert got == want
    for a, b in zip(got_tables, want_tables):
        _same_tables(a, b)
    assert [s["error"] is not None for s in got[0]] == [i == 4 for i in range(8)]
    assert with_t.templates.hits >= 5 and any(t.shared for t in with_t.templates._memo.values())
    live = {id(s): s for s in with_t.states[-8:]}  # type: ignore[attr-defined]  (the last round's states)
    for s in live.values():
        with_t.graph.entries.free(s.entry_ids)
    assert with_t.graph.entries.in_use() == 0 and not with_t.graph.entries._chains  # (no count left behind)


def test_a_failed_flush_leaves_no_shared_record_pointing_at_entries_never_sent():
    """A step's flush fails after a template recorded shared entries queued in that step: its requests are
    failed (`abandon`, as the runtime does), and the next step's equal requests store the chains again —
    tables and states equal per-request admission, never a count on entries that never reached the device."""
    from vllm_worker.worker import faults

    gen = torch.Generator().manual_seed(3)
    u = torch.nn.functional.normalize(torch.randn(D, generator=gen), dim=0)

    def payload(i: int) -> dict:
        st = Steer(list(SITES), u.expand(LAYERS, D).clone(), None, 1.0, False, op=ABLATE)
        return encode(RequestSpec(key=f"k{i}", steers=[st]))

    def run(adm: Admission) -> tuple[list, dict]:
        first = [adm.admit(f"r{i}", payload(i)) for i in range(4)]
        faults.STAGE = "flush"
        try:
            try:
                adm.flush()
                raise AssertionError("the injected fault did not fire")
            except faults.InjectedFault:
                for s in adm.abandon():  # (what `runtime._fail` gives back for them)
                    adm.graph.free_entries(s.entry_ids)
        finally:
            faults.STAGE = None
        assert len(first) == 4 and adm.graph.entries.in_use() == 0
        again = [adm.admit(f"r{i}", payload(i)) for i in range(4, 8)]
        adm.flush()
        return [_state(adm, s) for s in again], _tables(adm)

    with_t, without = _make(8, 8), _make(8, 0)
    got, got_table = run(with_t)
    want, want_table = run(without)
    assert got == want
    _same_tables(got_table, want_table)
    assert with_t.graph.entries.in_use() == without.graph.entries.in_use() > 0
