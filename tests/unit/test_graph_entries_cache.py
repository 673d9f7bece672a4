"""The layout memo of the graph path's chains (`interventions.chain_entries`, `SteeringEntries.layouts`):
a request equal in content to an earlier one is laid out from the memo and shares its entries; any
difference in content or fields lays out (and stores) its own; the memo holds no tensors, is bounded,
and admission that fails midway gives every entry use back. The table's contents (what the kernel reads)
are compared with a table filled without the memo."""

from __future__ import annotations

import pytest
import torch

from vllm_worker.protocol.ops import ABLATE, CAP, SET
from vllm_worker.worker import graph, interventions
from vllm_worker.worker.plan import DeviceSteer

D = 8


def _taps(monkeypatch: pytest.MonkeyPatch) -> graph.GraphTaps:
    monkeypatch.setenv("VLLM_LENS_STEER_MB", repr(64 * 2 * D * 4 / (1 << 20)))  # room for 64 entries
    return graph.GraphTaps([0, 1, 2], D, torch.float32, torch.device("cpu"), 16, None)


def _unit(seed: int, rows: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(rows, D, generator=g), dim=-1)


def _steers(v: torch.Tensor, **kw: object) -> list[DeviceSteer]:
    """An ablation at every site and, after it, a cap at site 1 (a chain of two entries there)."""
    fields = {"op": ABLATE, "span": None, "positions": None, "lo": None, "hi": None}
    fields.update(kw)
    a = DeviceSteer({0: 0, 1: 1, 2: 2}, v.clone(), None, 1.0, False, **fields)  # type: ignore[arg-type]
    cap = DeviceSteer({1: 0}, v[:1].clone(), None, 1.0, False, op=CAP, lo=-0.5, hi=0.5)
    return [a, cap]


def _table_rows(g: graph.GraphTaps, entries: dict) -> list:
    """What the kernel reads for a request: per site and chain, each entry's op, A, B, range, in order."""
    out = []
    for layer in sorted(entries):
        default, pos, ents, gen, split = entries[layer]
        for head in [default, gen, *ents.tolist()]:
            chain, e = [], head
            while e >= 0:
                chain.append((int(g.entries.op[e]), g.A[e].tolist(), g.B[e].tolist(), float(g.entries.lo[e])))
                e = int(g.entries.nxt[e])
            out.append((layer, pos.tolist(), split, chain))
    return out


def test_equal_content_is_laid_out_once_and_shares_entries(monkeypatch):
    g = _taps(monkeypatch)
    v = _unit(0)
    a = graph.request_entries(g, _steers(v))
    assert a is not None and len(g.entries.layouts) == 1
    used = g.entries.in_use()
    b = graph.request_entries(g, _steers(v))  # the same content in other tensors
    assert b is not None and len(g.entries.layouts) == 1 and g.entries.in_use() == used
    assert b[0] is a[0] and sorted(b[1]) == sorted(a[1])  # the memo's result, the same entries
    for _, pos, ents, *_ in b[0].values():  # shared between requests: read-only
        assert not pos.flags.writeable and not ents.flags.writeable
    # the memo holds keys and indexes only, never a request's tensors
    held = [x for x in _walk(g.entries.layouts) if isinstance(x, torch.Tensor)]
    assert held == []
    g.flush_entries()
    fresh = _taps(monkeypatch)
    monkeypatch.setattr(interventions, "LAYOUTS_KEPT", 0)  # (a memo of nothing: every request laid out anew)
    c = graph.request_entries(fresh, _steers(v))
    assert c is not None
    fresh.flush_entries()
    assert _table_rows(g, b[0]) == _table_rows(fresh, c[0])


def _walk(x: object) -> list:
    if isinstance(x, dict):
        return [y for k, v in x.items() for y in (*_walk(k), *_walk(v))]
    if isinstance(x, (list, tuple)):
        return [y for v in x for y in _walk(v)]
    return [x]


@pytest.mark.parametrize(
    "change",
    [
        "one_float",
        "op",
        "lo",
        "hi",
        "span",
        "positions",
        "scale",
    ],
)
def test_any_difference_lays_out_and_stores_its_own(monkeypatch, change):
    g = _taps(monkeypatch)
    v = _unit(1)
    base = _steers(v, op=CAP, lo=-1.0, hi=1.0)
    a = graph.request_entries(g, base)
    assert a is not None
    other = _steers(v, op=CAP, lo=-1.0, hi=1.0)
    if change == "one_float":
        w = v.clone()
        w[1, 3] = torch.nextafter(w[1, 3], torch.tensor(2.0))
        other[0].vectors = w
    elif change == "op":
        other[0].op, other[0].lo, other[0].hi = ABLATE, None, None
    elif change == "lo":
        other[0].lo = -0.75
    elif change == "hi":
        other[0].hi = 0.75
    elif change == "span":
        other[0].span = (0, 4)
    elif change == "positions":  # a 3-D vector: one row per named position
        other[0].vectors = v.unsqueeze(1).expand(3, 2, D).clone()
        other[0].positions = [2, 5]
    elif change == "scale":
        other[0].scale = 2.0
    b = graph.request_entries(g, other)
    assert b is not None and len(g.entries.layouts) == 2
    if change == "span":  # the same entries (a span is where they apply: the layout's split), another layout
        assert a[0][0][4] == -1 and b[0][0][4] == 4 and b[0][0][0] == a[0][0][0] and b[0][0][3] == -1
    else:  # other entries at site 0
        assert not set(_heads(a[0], 0)) & set(_heads(b[0], 0))
    g.flush_entries()
    fresh = _taps(monkeypatch)
    monkeypatch.setattr(interventions, "LAYOUTS_KEPT", 0)
    c = graph.request_entries(fresh, other)
    assert c is not None
    fresh.flush_entries()
    assert _table_rows(g, b[0]) == _table_rows(fresh, c[0])


def _heads(entries: dict, layer: int) -> list[int]:
    default, _, ents, gen, _ = entries[layer]
    return [e for e in (default, gen, *ents.tolist()) if e >= 0]


def test_a_set_with_other_kept_columns_is_other_content(monkeypatch):
    g = _taps(monkeypatch)
    v = _unit(2)
    keep = torch.ones(D)
    keep[:2] = 0
    a = graph.request_entries(g, [DeviceSteer({0: 0}, v[:1].clone(), None, 1.0, False, op=SET, keep=keep.clone())])
    keep2 = keep.clone()
    keep2[2] = 0
    b = graph.request_entries(g, [DeviceSteer({0: 0}, v[:1].clone(), None, 1.0, False, op=SET, keep=keep2)])
    assert a is not None and b is not None and a[0][0][0] != b[0][0][0] and len(g.entries.layouts) == 2


def test_entries_go_back_with_the_last_holder_and_are_stored_anew_after(monkeypatch):
    g = _taps(monkeypatch)
    v = _unit(3)
    got = [graph.request_entries(g, _steers(v)) for _ in range(5)]
    assert all(x is not None for x in got)
    n = g.entries.in_use()
    assert n == 4  # three ablations and one cap, held once for five requests
    g.flush_entries()
    for x in got[:-1]:
        g.free_entries(x[1])  # type: ignore[index]
        assert g.entries.in_use() == n
    g.free_entries(got[-1][1])  # type: ignore[index]
    assert g.entries.in_use() == 0 and g.entries.shared_chains() == 0
    # the memo outlives its entries: a later equal request stores them again, from its own vectors
    w = _steers(v)
    again = graph.request_entries(g, w)
    assert again is not None and g.entries.in_use() == n and set(again[1]) == set(g.entries._new)
    g.flush_entries()
    assert torch.equal(g.A[again[0][0][0]], v[0])


def test_the_memo_is_bounded(monkeypatch):
    g = _taps(monkeypatch)
    monkeypatch.setattr(interventions, "LAYOUTS_KEPT", 4)
    for seed in range(10):
        x = graph.request_entries(g, [DeviceSteer({0: 0}, _unit(seed, 1), None, 1.0, False, op=ABLATE)])
        assert x is not None
        g.free_entries(x[1])
        assert len(g.entries.layouts) <= 4
    assert g.entries.in_use() == 0


def test_a_full_table_takes_nothing_and_keeps_no_count(monkeypatch):
    monkeypatch.setenv("VLLM_LENS_STEER_MB", repr(3 * 2 * D * 4 / (1 << 20)))  # room for 3 entries
    g = graph.GraphTaps([0, 1, 2], D, torch.float32, torch.device("cpu"), 16, None)
    v = _unit(4)
    assert graph.request_entries(g, _steers(v)) is None  # four entries do not fit
    assert g.entries.in_use() == 0 and g.entries.shared_chains() == 0
    one = [DeviceSteer({0: 0}, v[:1].clone(), None, 1.0, False, op=ABLATE)]
    x = graph.request_entries(g, one)
    y = graph.request_entries(g, one)
    assert x is not None and y is not None and g.entries.in_use() == 1


def test_a_failed_admission_midway_gives_every_entry_back(monkeypatch):
    """Admission that fails after its request's entries were taken (here: queuing its device copies)
    fails that request, and the shared entries' counts are as before it."""
    from vllm_worker.protocol.points import OUT, site
    from vllm_worker.protocol.spec import RequestSpec, Steer, encode
    from vllm_worker.worker.admission import Admission
    from vllm_worker.worker.store import CaptureStore

    monkeypatch.setenv("VLLM_LENS_STEER_MB", "1")
    sites = [site(l, OUT) for l in range(3)]
    g = graph.GraphTaps(sites, D, torch.float32, torch.device("cpu"), 16, None)
    store = CaptureStore(torch.device("cpu"))
    args = (None, torch.device("cpu"), torch.float32, D, frozenset(sites), frozenset(range(3)), {}, True, None, store)
    adm = Admission(*args, g, None, None)  # type: ignore[arg-type]
    v = _unit(5)

    def payload(i: int, rows: torch.Tensor, layers: list[int]) -> dict:
        st = Steer([sites[l] for l in layers], rows.clone(), None, 1.0, False, op=ABLATE)
        plain = Steer([sites[2]], rows[:1].clone(), None, 1.0, False)  # (on the Python path: a copy to queue)
        return encode(RequestSpec(key=f"k{i}", steers=[st, plain]))

    ok = adm.admit("r0", payload(0, v[:2], [0, 1]))
    assert ok.entry_ids and ok.store is None
    held = g.entries.in_use()
    refs = list(g.entries._refs)

    def broken(*a: object) -> None:
        raise RuntimeError("queue broke")

    monkeypatch.setattr(adm._moves, "add", broken)
    bad = adm.admit("r1", payload(1, v[:2], [0, 1]))  # the same content: it took uses of r0's entries
    assert bad.entry_ids == [] and not bad.entries and bad.store is not None and bad.store.error is not None
    assert g.entries.in_use() == held and g.entries._refs == refs
    monkeypatch.undo()


def test_steering_rows_lay_out_as_before_for_named_positions(monkeypatch):
    """A 3-D vector's named positions: each position's chain, and -1 where only an earlier span applied."""
    g = _taps(monkeypatch)
    v = _unit(6)
    three = DeviceSteer(
        {0: 0}, v[:1].unsqueeze(1).expand(1, 2, D).clone(), None, 1.0, False, [3, 9], op=ABLATE, span=(0, 5)
    )
    got = graph.request_entries(g, [three])
    assert got is not None
    default, pos, ents, gen, split = got[0][0]
    assert pos.tolist() == [3, 9] and split == 5 and default == -1 and gen == -1
    g.flush_entries()
    assert ents[0] >= 0 and ents[1] == -1 and int(g.entries.op[ents[0]]) == ABLATE


def test_gated_chains_are_never_shared_and_reuse_only_their_rows(monkeypatch):
    """A probe action's steering (gated per request) gets entries of its own even when an ungated request
    stores the same content (never a chain found stored and silently left without entries), with rows
    equal to a table filled without the memo; the rows memo is bounded and holds no view of a request's
    vectors."""
    from vllm_worker.worker import graph_entries

    g = _taps(monkeypatch)
    v = _unit(7, 1)
    plain = DeviceSteer({1: 0}, v.clone(), None, 2.0, False)
    p = graph.request_entries(g, [plain])
    assert p is not None and p[0][1][0] >= 0
    gated = [DeviceSteer({1: 0}, v.clone(), None, 2.0, False) for _ in range(3)]
    got = [graph.request_entries(g, [st], gated=True) for st in gated]
    heads = [x[0][1][0] for x in got if x is not None]
    assert len(heads) == 3 and min(heads) >= 0 and len({p[0][1][0], *heads}) == 4
    assert g.entries.in_use() == 4
    g.flush_entries()
    assert all(float(g.entries.gate[h]) == 0.0 for h in heads) and float(g.entries.gate[p[0][1][0]]) == 1.0
    for h in heads:
        assert torch.equal(g.A[h], g.A[p[0][1][0]]) and torch.equal(g.A[h], 2.0 * v[0])
    ptrs = {st.vectors.untyped_storage().data_ptr() for st in gated} | {plain.vectors.untyped_storage().data_ptr()}
    for a, b, *_ in g.entries._rows_memo.values():  # (each a tuple of row views of one tensor)
        assert a[0].untyped_storage().data_ptr() not in ptrs and b[0].untyped_storage().data_ptr() not in ptrs
    monkeypatch.setattr(graph_entries, "ROWS_KEPT", 2)
    for seed in range(6):
        st = DeviceSteer({0: 0}, _unit(seed + 20, 1), None, 1.0, False)
        x = graph.request_entries(g, [st], gated=True)
        assert x is not None
        assert len(g.entries._rows_memo) <= 2
