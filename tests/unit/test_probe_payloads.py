"""A fetch's probe payloads computed together (`worker.probe_payloads`) equal each request's own
`probes.payload` bit for bit — requests of different lengths (compositions changing as requests finish, so
requests' rows span different records: several groups), logit and sigmoid probes of one and two outputs —
and what it does not cover is left to `probes.payload` (None): a probe over two layers, a position filed
twice; read from the requests' filed entries (`probe_filing`) or from their `ProbeScores` alike;
`fetch.assemble_all` gives every request the same payload either way, a request's probes as one block
(`probe_wire.pack_block`) or as items, and the frontend decodes a block to the same tensors as its items."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from support.filing import file_steps
from vllm_worker.protocol import probe_wire
from vllm_worker.protocol.wire import tensor_to_bytes
from vllm_worker.worker import fetch, probe_payloads, probes, ready_probes
from vllm_worker.worker.request_results import RequestResults

D = 16
PROBES = {
    "a": ([1], "logit", 1),
    "b": ([1], "sigmoid", 2),
    "c": ([3], "sigmoid", 1),
    "two": ([1, 3], "logit", 1),
    "d": ([3], "logit", 1),
    "e": ([1], "logit", 2),
}


def _requests(names_of: list[list[str]]) -> list[SimpleNamespace]:
    g = torch.Generator().manual_seed(3)
    wp = probes.WorkerProbes(torch.device("cpu"), frozenset(range(4)))
    for name, (layers, output, n_out) in PROBES.items():
        w = torch.randn(n_out, D * len(layers), generator=g)
        wire = {"layers": layers, "point": "resid_post", "output": output, "weight": tensor_to_bytes(w)}
        wp.load(name, name, {**wire, "bias": tensor_to_bytes(torch.randn(n_out, generator=g))})
    return [
        SimpleNamespace(probes=wp.uses([{"probe": n, "uid": n} for n in names]), store=RequestResults([]))
        for names in names_of
    ]


def _stage(reqs: list, live: list[int], width: int) -> SimpleNamespace:
    """A composition of the `live` requests, `width` rows each, at every site their probes read."""
    sites = sorted({s for r in reqs for u in r.probes for s in u.weights})
    col = {s: i for i, s in enumerate(sites)}
    e = np.zeros(0, dtype=np.int64)
    gp = SimpleNamespace(n=len(live) * width, cap_rows=e, cap_cols=e, n_extra=0, probes={}, sae={})
    by_site = {
        s: [
            (reqs[r], i * width, (i + 1) * width)
            for i, r in enumerate(live)
            if any(s in u.weights for u in reqs[r].probes)
        ]
        for s in sites
    }
    rows = lambda it: np.concatenate([np.arange(a, b) for _, a, b in it])  # noqa: E731
    probes.stage_probes(gp, {s: it for s, it in by_site.items() if it}, col, rows)
    gp.total = len(gp.cap_rows)
    return gp


def _read(reqs: list, read: str) -> list:
    """What a fetch hands `probe_payloads`: each request's `RequestResults` (read from its filed entries while
    none of its `ProbeScores` were made) or, `slots`, its `ProbeScores` (made here: the slots' path)."""
    return [r.store for r in reqs] if read == "entries" else [r.store.probes for r in reqs]


def _run(reqs: list, lengths: list[int], redo: bool) -> None:
    """A prefill of positions 0..2 (three rows a request), then decode steps; `redo`: position 5 is filed
    twice (a preempted request's recompute)."""
    g = torch.Generator().manual_seed(4)

    def file(gp: SimpleNamespace, pos: np.ndarray) -> None:
        probes.scores_from_stage(gp, torch.randn(gp.total, D, generator=g), 0, pos)

    file_steps(lambda live, rows: _stage(reqs, live, rows), file, lengths, 3, (6, 5) if redo else None)


@pytest.mark.parametrize("read", ["entries", "slots"])
@pytest.mark.parametrize("redo", [False, True])
def test_payloads_together_equal_each_request_alone(redo, read):
    lengths = [4, 9, 9, 20, 7, 30, 3, 20]
    names = [["a", "b", "c"]] * 6 + [["a", "two"], ["c"]]
    reqs = _requests(names)
    _run(reqs, lengths, redo)
    cache = fetch.shared_records(len(reqs))
    assert cache is not None
    together = probe_payloads.payloads(_read(reqs, read), cache)
    assert all(r.store._expanded == 0 for r in reqs) or read == "slots"  # (read from the entries: no slot made)
    for i, r in enumerate(reqs):
        alone = probes.payload(r.store.probes)
        covered = "two" not in names[i] and not (redo and lengths[i] > 6)
        assert (together[i] is not None) == covered, i
        if together[i] is not None:
            assert together[i] == alone  # the same bytes, shapes and dtypes
            assert list(together[i]) == names[i]  # type: ignore[arg-type]
        pos = probe_wire.arrays(alone["a" if "a" in alone else "c"], "a")[0].tolist()
        assert pos == sorted({k if not (redo and k == 6) else 5 for k in range(lengths[i])})


def test_a_fetch_gives_every_request_its_own_payload_either_way():
    lengths = [4, 9, 9, 20, 7]
    names = [["a", "b", "c"]] * 4 + [["a", "two"]]
    reqs = _requests(names)
    _run(reqs, lengths, False)
    reqs[2].store.error = {"kind": "hook", "message": "failed"}
    todo = [(None, None, r.store, n) for r, n in zip(reqs, lengths)]
    together = fetch.assemble_all(todo, [], None, None)
    for i in range(len(reqs)):
        (alone,) = fetch.assemble_all([todo[i]], [], None, None)
        assert together[i] == alone
    assert "probes" not in together[2] and together[2]["error"]["kind"] == "hook"
    scores = torch.from_numpy(probe_wire.arrays(together[0]["probes"]["b"], "b")[1].copy())
    assert scores.shape == (4, 2) and bool(((scores > 0) & (scores < 1)).all())  # sigmoid, two outputs


def test_a_failure_of_the_batched_pass_leaves_every_request_to_its_own(monkeypatch, caplog):
    lengths = [4, 9, 9]
    reqs = _requests([["a", "b", "c"]] * 3)
    _run(reqs, lengths, False)
    todo = [(None, None, r.store, n) for r, n in zip(reqs, lengths)]
    want = fetch.assemble_all(todo, [], None, None)

    def boom(*_: object) -> None:
        raise IndexError("boom")

    monkeypatch.setattr(probe_payloads, "payloads", boom)
    assert fetch.assemble_all(todo, [], None, None) == want
    assert [r.levelname for r in caplog.records if r.name == "vllm_worker"] == ["WARNING"]  # said, not silent


@pytest.mark.parametrize("redo", [False, True])
def test_progress_together_equals_each_running_request_alone(redo):
    """A progress RPC's asks (each from its own start: 0, inside, at the end, past it) computed together
    equal `probes.payload(..., running=True)` of each request bit for bit."""
    lengths = [4, 9, 9, 20, 7, 30, 3, 20]
    names = [["a", "b", "c"]] * 6 + [["a", "two"], ["c"]]
    starts = [0, 2, 9, 5, 40, 17, 1, 19]
    reqs = _requests(names)
    _run(reqs, lengths, redo)
    asks = [(f"k{i}", 0, s, r.store) for i, (r, s) in enumerate(zip(reqs, starts))]
    together = probe_payloads.together([a[3].probes for a in asks], {}, [a[2] for a in asks])
    for i, r in enumerate(reqs):
        alone = probes.payload(r.store.probes, starts[i], running=True, cache={})
        covered = "two" not in names[i] and not (redo and lengths[i] > 6)
        assert (together[i] is not None) == covered, i
        if together[i] is not None:
            assert together[i] == alone, i  # the same bytes, shapes and dtypes
        pos = probe_wire.arrays(alone["a" if "a" in alone else "c"], "a")[0].tolist()
        assert pos == [
            k for k in sorted({k if not (redo and k == 6) else 5 for k in range(lengths[i])}) if k >= starts[i]
        ]
    assert probe_payloads.together([asks[0][3].probes], {}, [asks[0][2]]) == [None]  # one ask: the per-request path


@pytest.mark.parametrize("read", ["entries", "slots"])
@pytest.mark.parametrize("starts", [None, [0, 4, 9, 2, 30]])
def test_requests_of_one_composition_at_their_own_positions(starts, read):
    """Requests filed in the same records at different positions (their own prompt lengths), two of them
    filing a position twice mid-batch (a preempted request's recompute) while the others rise: the group
    reads each member's positions apart (not member 0's), leaves only those to `probes.payload` (request 3
    repeats a position across the prefill's and the decode's records), and
    every other payload — fetch or progress RPC (`starts`) — equals the request's own bit for bit."""
    names = [["a", "b", "c"], ["a", "b"], ["a", "b", "c"], ["c"], ["a", "b", "c"]]
    offsets = [0, 5, 2, 5, 0]  # request 1 and 3 at other positions than request 0; 4 at the same
    reqs = _requests(names)
    live = list(range(len(reqs)))
    g = torch.Generator().manual_seed(5)
    gp = _stage(reqs, live, 3)
    probes.scores_from_stage(
        gp, torch.randn(gp.total, D, generator=g), 0, np.concatenate([o + np.arange(3) for o in offsets])
    )
    gp = _stage(reqs, live, 1)
    for step in range(3, 12):
        pos = np.array([o + step for o in offsets], dtype=np.int64)
        if step == 7:
            pos[2] -= 1  # request 2 files its previous position again
        if step == 3:
            pos[3] -= 1  # request 3 its prefill's last one (across the records: the group's parts)
        probes.scores_from_stage(gp, torch.randn(gp.total, D, generator=g), 0, pos)
    together = probe_payloads.together(_read(reqs, read), fetch.shared_records(len(reqs)) or {}, starts)
    for i, r in enumerate(reqs):
        if starts is None:
            alone = probes.payload(r.store.probes)
        else:
            alone = probes.payload(r.store.probes, starts[i], running=True, cache={})
        assert (together[i] is None) == (i in (2, 3)), i
        if together[i] is not None:
            assert together[i] == alone, i  # the same bytes, shapes and dtypes
            assert list(together[i]) == names[i]  # type: ignore[arg-type]
        pos = probe_wire.arrays(alone[names[i][0]], "p")[0].tolist()
        if i not in (2, 3):
            want = sorted({offsets[i] + k for k in range(12)})
            assert pos == [p for p in want if starts is None or p >= starts[i]], i


def test_the_index_kept_as_spans_are_filed_is_the_walk():
    """Each slot's index (`ProbeScores.index`, kept as compositions are filed) is what `_walk` reads at a fetch,
    and a fetch takes it: no span walked (so the tests above run the indexed path)."""
    lengths = [4, 9, 9, 20, 7, 30, 3, 20]
    names = [["a", "b", "c"]] * 6 + [["a", "two"], ["c"]]
    reqs = _requests(names)
    _run(reqs, lengths, False)
    cache = fetch.shared_records(len(reqs)) or {}
    for r in reqs:
        for slot in r.store.probes.values():
            spans = slot.spans[slot.probe.sites[0]]
            assert len(slot.key) == len(spans) > 0
            key, walked, firsts = probe_payloads._walk(slot, cache, {})
            assert (key, firsts) == (tuple(slot.key), tuple(slot.firsts)) and walked == spans
    calls = []
    walk = probe_payloads._walk
    probe_payloads._walk = lambda *a: calls.append(a) or walk(*a)  # type: ignore[assignment]
    try:
        got = probe_payloads.payloads([r.store.probes for r in reqs[:6]], cache)
    finally:
        probe_payloads._walk = walk  # type: ignore[assignment]
    assert calls == [] and got == [probes.payload(r.store.probes) for r in reqs[:6]]


def test_spans_the_index_does_not_cover_are_walked():
    """Spans added without the index (here a position filed twice: left to `probes.payload`), or a record
    with nothing filed (which `_walk` skips but an index counts: those slots walked and regrouped): every
    payload made here still equals the request's own bit for bit, each request's probes in its own order."""
    lengths = [4, 9, 9, 20, 7]
    names = [["c", "a", "b"], ["a", "b", "c"], ["b", "c", "a"], ["a", "b", "c"], ["a", "c", "b"]]
    reqs = _requests(names)
    _run(reqs, lengths, False)
    empty = probes.StepRecord(1, {"scores": (3, torch.float32)}, torch.device("cpu"))  # nothing filed
    for i, r in enumerate(reqs):
        slot = r.store.probes["a"]
        if i % 2 == 0:  # indexed, but its record has nothing filed: `_walk` skips the span
            spans = slot.spans[slot.probe.sites[0]]
            spans.append(probes.Span(empty, 0, 1, "scores", slice(0, 1)))
            slot.index(len(spans), id(empty), 1, 1, 0, 0)
            assert len(slot.key) == len(spans)
        else:  # appended past the index (its last span again: positions filed twice): walked, and left
            spans = slot.spans[slot.probe.sites[0]]
            spans.append(spans[-1])
    together = probe_payloads.payloads([r.store.probes for r in reqs], fetch.shared_records(len(reqs)) or {})
    for i, r in enumerate(reqs):
        alone = probes.payload(r.store.probes)
        assert (together[i] is None) == (i % 2 == 1), i
        if together[i] is not None:
            assert together[i] == alone, i
            assert list(together[i]) == list(alone) == list(r.store.probes), i  # type: ignore[arg-type]
    slot = reqs[0].store.probes["c"]
    spans = slot.spans[slot.probe.sites[0]]
    n = len(slot.key)
    spans.append(probes.Span(empty, 0, 1, "scores", slice(0, 1)))  # filed without the index
    slot.index(len(spans) + 1, id(empty), 1, 1, 0, 0)  # a later one: not indexed either (the index has a gap)
    assert len(slot.key) == n < len(spans)  # not indexed: walked from now on


def test_rising_same_read_in_the_gathered_layout_equals_the_member_major_reading():
    """`_rising_same` / `_member_positions` read each member's positions across steps and parts without a
    member-major copy: random groups (members whose positions differ, fall, repeat) against that copy."""
    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(1, 5))
        parts = []
        for _ in range(int(rng.integers(1, 4))):
            steps, rows = int(rng.integers(1, 4)), int(rng.integers(1, 4))
            base = np.sort(rng.integers(0, 12, size=steps * rows)).reshape(steps, 1, rows)
            p = np.repeat(base, n, axis=1)  # (steps, members, rows)
            for k in range(n):
                if rng.random() < 0.3:
                    p[rng.integers(0, steps), k, rng.integers(0, rows)] = rng.integers(0, 12)
            parts.append(p)
        full = np.concatenate([p.transpose(1, 0, 2).reshape(n, -1) for p in parts], axis=1)
        rising, same = probe_payloads._rising_same(parts, n)
        assert rising == [bool((f[1:] > f[:-1]).all()) for f in full]
        assert same == [bool((f == full[0]).all()) for f in full]
        for k in range(n):
            assert np.array_equal(probe_payloads._member_positions(parts, k), full[k])


def test_the_index_grows_in_place_over_many_compositions():
    """A long request sees a composition per batch change (hundreds over its life): its index is appended in
    place — the same list objects, one entry per composition — not re-made each time (a tuple re-made per
    composition made each composition's filing cost grow with the request's age: 0.48 -> 19 ms at 600
    compositions, 64 requests x 8 probes on the VM); payloads together still equal each request's own."""
    reqs = _requests([["a", "b", "c"]] * 3)
    g = torch.Generator().manual_seed(5)
    kept: dict[int, tuple] = {}
    for k in range(40):  # a composition per step, the first request always in it
        live = [0] + [1 + (k % 2)] if k % 3 else [0, 1, 2]
        gp = _stage(reqs, live, 1)
        probes.scores_from_stage(gp, torch.randn(gp.total, D, generator=g), 0, np.full(len(live), k, dtype=np.int64))
        slot = reqs[0].store.probes["a"]
        assert len(slot.key) == k + 1 == len(slot.spans[slot.probe.sites[0]]) and len(slot.firsts) == 2 * (k + 1)
        if k == 0:
            kept = {id(s): (s.key, s.firsts) for s in reqs[0].store.probes.values()}
        assert all((s.key, s.firsts) == kept[id(s)] for s in reqs[0].store.probes.values())
        assert all(s.key is kept[id(s)][0] and s.firsts is kept[id(s)][1] for s in reqs[0].store.probes.values())
    got = probe_payloads.payloads([r.store.probes for r in reqs], fetch.shared_records(len(reqs)) or {})
    assert got == [probes.payload(r.store.probes) for r in reqs] and all(p is not None for p in got)


@pytest.mark.parametrize(
    "names, kinds",
    [
        (  # a and d at sites with as many rows and columns (two's beside each): one record a composition
            [["a", "d"], ["d", "a"], ["a", "d"], ["a", "d"], ["d", "a"], ["a", "d"], ["a", "d"], ["two", "a"]],
            ["block", "block", "block", "block", "block", "block", "block", "left"],
        ),
        (  # e beside a at site 1: site 3 narrower (records apart), e wider than a (groups apart); a lone
            # probe's request: items (a block of one saves nothing)
            [["a", "d"], ["a", "e"], ["a", "d"], ["e"], ["d"], ["a"], ["d", "a"], ["two", "a"]],
            ["items", "items", "items", "items", "items", "items", "items", "left"],
        ),
    ],
)
@pytest.mark.parametrize("read", ["entries", "slots"])
def test_a_fetch_sends_a_request_s_probes_as_one_block_with_the_bytes_of_its_items(names, kinds, read):
    """`blocks`: a request of several probes, all in one group's usual case (logit, rising, member 0's
    positions), gets one block — its items' bytes, in its order; a request whose probes fall in two groups
    (another record, or outputs of another width) gets items, one over two layers is left to
    `probes.payload`; every one equals the request's own `probes.payload`. Several groups (requests of different
    lengths)."""
    lengths = [4, 9, 9, 20, 7, 30, 3, 20]
    reqs = _requests(names)
    _run(reqs, lengths, False)
    got = probe_payloads.payloads(_read(reqs, read), fetch.shared_records(len(reqs)) or {}, blocks=True)
    seen = []
    for i, r in enumerate(reqs):
        alone = probes.payload(r.store.probes)
        if got[i] is None:
            seen.append("left")
            continue
        if isinstance(got[i], tuple):
            seen.append("block")
            part = {"probes": got[i][0], probe_wire.BLOCK: got[i][1]}  # type: ignore[index]
        else:
            seen.append("items")
            part = {"probes": got[i]}
        assert probe_wire.items_of(part) == alone, i
        assert list(part["probes"]) == list(alone) == list(r.store.probes), i
    assert seen == kinds
    todo = [(None, None, r.store, n) for r, n in zip(reqs, lengths)]
    parts = fetch.assemble_all(todo, [], None, None)
    assert [probe_wire.BLOCK in p for p in parts] == [k == "block" for k in kinds]
    for i, part in enumerate(parts):
        (alone,) = fetch.assemble_all([todo[i]], [], None, None)  # (a lone request: items)
        assert probe_wire.BLOCK not in alone and probe_wire.items_of(part) == alone["probes"], i


def test_the_frontend_decodes_a_block_as_its_items():
    """Every score and aggregate decoded from blocks equals those decoded from the same parts as items
    (`torch.equal`); each sample's scores are views of its own buffer (one kept sample pins no other's);
    a malformed block is a ValueError naming the field."""
    from vllm_worker.frontend.probe_results import probe_outputs, probe_outputs_many

    lengths = [9, 9, 20, 7, 30]
    names = [["a", "d"], ["d", "a"], ["a", "d"], ["d", "a"], ["a", "d"]]
    reqs = _requests(names)
    _run(reqs, lengths, False)
    parts = fetch.assemble_all([(None, None, r.store, n) for r, n in zip(reqs, lengths)], [], None, None)
    assert all(probe_wire.BLOCK in p for p in parts)
    opts = {"aggregate": ["mean", "max", "last", "ema:0.5"], "positions": "generated"}
    wanted = [{n: opts for n in ns} for ns in names]
    as_items = [{"probes": probe_wire.items_of(p)} for p in parts]
    got = probe_outputs_many([([p], w, 3) for p, w in zip(parts, wanted)])
    want = probe_outputs_many([([p], w, 3) for p, w in zip(as_items, wanted)])
    for (s1, a1), (s2, a2) in zip(got, want):
        assert list(s1) == list(s2) and list(a1) == list(a2)
        for name in s1:
            assert torch.equal(s1[name], s2[name]) and list(a1[name]) == list(a2[name])
            assert all(torch.equal(a1[name][k], a2[name][k]) for k in a1[name])
    ptrs = [{t.untyped_storage().data_ptr() for t in s.values()} for s, _ in got]
    assert all(len(p) == 1 for p in ptrs) and len(set.union(*ptrs)) == len(parts)
    bad = {**parts[0], probe_wire.BLOCK: {**parts[0][probe_wire.BLOCK], "scores": b"1234"}}
    with pytest.raises(ValueError, match=r"^probe_scores\.scores"):
        probe_outputs([bad], wanted[0], 3)


def test_rising_same_by_record_row_equals_the_gathered_reading():
    """A one-row span's positions read by record row (`(record positions, each member's row)`) give the
    same `_rising_same` / `_member_positions` as gathered per member: random records (rows falling,
    repeating, members sharing rows), beside gathered parts."""
    rng = np.random.default_rng(1)
    for _ in range(300):
        n, n_rows = int(rng.integers(1, 6)), int(rng.integers(1, 5))
        parts, gathered = [], []
        for _ in range(int(rng.integers(1, 4))):
            steps = int(rng.integers(1, 5))
            rec = np.cumsum(rng.integers(0, 3, size=(steps, n_rows)), axis=0) + rng.integers(0, 3, size=n_rows)
            r0 = rng.integers(0, n_rows, size=n)
            parts.append((rec, r0))
            gathered.append(np.take(rec, r0, axis=1).reshape(steps, n, 1))
        assert probe_payloads._rising_same(parts, n) == probe_payloads._rising_same(gathered, n)
        for k in range(n):
            assert np.array_equal(
                probe_payloads._member_positions(parts, k), probe_payloads._member_positions(gathered, k)
            )


class _Ran:
    """A record's event (`StepRecord.mark`) as this test sets it: whether the steps written there have run."""

    def __init__(self, ran: bool) -> None:
        self.ran = ran

    def query(self) -> bool:
        return self.ran


def test_results_made_while_a_step_runs_read_only_records_that_have_run(monkeypatch):
    """`ready_probes.prepare` while the device still runs a step (`running`): a finished request is made only
    when every record its scores were filed in has run (a record never marked is not known to have: CPU's),
    a chunk at a time while the step runs; what it makes is what the idle pass makes."""
    reqs = _requests([["a", "b", "c"]] * 6)
    _run(reqs, [4, 9, 9, 20, 7, 30], False)
    stores = [r.store for r in reqs]
    for st in stores:
        st.finished = True
    assert ready_probes.prepare(stores, running=lambda: True) == 0  # (never marked)
    last = stores[5].probe_filed[-1][0].record  # request 5 alone, its last steps: still running
    for rec in {id(e[0].record): e[0].record for st in stores for e in st.probe_filed}.values():
        rec.event = _Ran(rec is not last)
    monkeypatch.setattr(ready_probes, "EARLY_CHUNK", 2)
    looks = iter([True, True, False])  # the step ends after two chunks
    assert ready_probes.prepare(stores, running=lambda: next(looks)) == 4
    early = [st.ready for st in stores]
    assert [p is not None for p in early] == [True] * 4 + [False] * 2
    for st in stores:
        st.ready = None
    assert ready_probes.prepare(stores) == 6  # the device idle: every finished request
    assert early[:4] == [st.ready for st in stores[:4]]
