"""The layout of whole-row chains at mlp_post (`interventions.WHOLE`): a request's steering at the tap's own
site becomes one chain per position class whose every step is `pieces` consecutive entries, pointed at from
every piece's column; a table without such a run of free entries refuses the request (it takes the Python
path, as when entries do not fit), gives nothing away and keeps its free list; what the graph path does not
serve (a chain over `MAX_WHOLE_STEPS` steps, a probe action's gated steering, TP) leaves the pieces without
entries, and `wide_needs_python` sends the request to the Python path."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_worker.protocol import points
from vllm_worker.protocol.ops import ABLATE, ADD, CAP, SET
from vllm_worker.worker import graph
from vllm_worker.worker.interventions import MAX_WHOLE_STEPS, TAIL, WHOLE, steer_rows
from vllm_worker.worker.plan import DeviceSteer, RequestState
from vllm_worker.worker.python_path import wide_needs_python

D, W, PIECES = 8, 20, 3  # pieces of 8, 8, 4
TAP = points.site(0, points.MLPPOST)
PS = points.mlp_piece_sites(0, PIECES)
WIDE = {TAP: [(s, j * D, min((j + 1) * D, W)) for j, s in enumerate(PS)]}


def _taps(monkeypatch: pytest.MonkeyPatch, n_entries: int = 64) -> graph.GraphTaps:
    monkeypatch.setenv("VLLM_LENS_STEER_MB", repr(n_entries * 2 * D * 4 / (1 << 20)))
    g = graph.GraphTaps(
        [points.site(0, points.IN), *PS, points.site(0, points.OUT)], D, torch.float32, torch.device("cpu"), 8, None
    )
    g.wide = WIDE
    return g


def _v(seed: int, rows: int = 1) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(rows, W, generator=torch.Generator().manual_seed(seed)), dim=-1)


def _st(v: torch.Tensor, **kw: object) -> DeviceSteer:
    scale, norm = float(kw.pop("scale", 1.0)), bool(kw.pop("norm_match", False))
    return DeviceSteer({TAP: 0}, v, None, scale, norm, **kw)  # type: ignore[arg-type]


def test_a_whole_row_chain_is_consecutive_pieces_pointed_at_from_every_piece(monkeypatch):
    g = _taps(monkeypatch)
    steers = [
        _st(_v(1), op=ABLATE),
        _st(_v(2) * 3, scale=2.0),
        _st(_v(3), scale=0.5, norm_match=True),  # (one step with the add before it: B used)
        _st(_v(4), op=CAP, lo=-0.5, hi=0.25),
        _st(_v(5), op=SET),
    ]
    got = graph.request_entries(g, steers)
    assert got is not None
    g.flush_entries()
    entries, ids = got
    assert set(entries) == set(PS)
    assert len({entries[p][0] for p in PS}) == 1 and all(entries[p][3] == -1 for p in PS)
    head = entries[PS[0]][0]
    assert ids == list(range(head, head + 4 * PIECES))  # 4 steps (ablate, add run, cap, set) x 3 pieces
    e = g.entries
    ops, nxt = e.op.tolist(), e.nxt.tolist()
    want = [ABLATE, ADD, CAP, SET]
    for k, op in enumerate(want):
        h = head + k * PIECES
        assert [ops[h + j] for j in range(PIECES)] == [op | WHOLE] + [op | WHOLE | TAIL] * (PIECES - 1)
        assert nxt[h] == (h + PIECES if k + 1 < len(want) else -1)
    add = head + PIECES
    assert int(e.bflag[add]) == 1  # the norm-matched part: B's flag on the step's head
    assert (float(e.lo[head + 2 * PIECES]), float(e.hi[head + 2 * PIECES])) == (-0.5, 0.25)
    row = torch.cat([e.A[head + j] for j in range(PIECES)])  # the ablation's direction, padded to 3 x 8
    assert torch.equal(row[:W], _v(1)[0]) and torch.equal(row[W:], torch.zeros(PIECES * D - W))


def test_no_run_of_free_entries_refuses_and_keeps_the_table(monkeypatch):
    """Free entries enough in number but none consecutive: refused (None, counted), nothing taken."""
    g = _taps(monkeypatch, n_entries=12)
    held = g.entries.add(torch.zeros(12, D), torch.zeros(12, D))
    assert held is not None
    g.entries.free(held[::2])  # 6 free, none next to another
    free = sorted(g.entries._free)
    assert graph.request_entries(g, [_st(_v(1), op=ABLATE)]) is None
    assert sorted(g.entries._free) == free and g.entries.full == 1
    g.entries.free(held[1::2])
    got = graph.request_entries(g, [_st(_v(1), op=ABLATE)])
    assert got is not None and got[1] == list(range(got[1][0], got[1][0] + PIECES))


def _state(steers: list, entries: dict | None) -> RequestState:
    return RequestState([], {}, 0, steers, [], None, entries=entries)


def test_what_the_graph_path_does_not_serve_takes_the_python_path(monkeypatch):
    g = _taps(monkeypatch)
    ok = [_st(_v(1), op=ABLATE)]
    got = graph.request_entries(g, ok)
    assert got is not None and not wide_needs_python(_state(ok, got[0]), WIDE)
    # more steps than the kernel keeps scalars for: no entries at the pieces
    long = [_st(_v(i), op=ABLATE if i % 2 else CAP, lo=-1.0, hi=1.0) for i in range(MAX_WHOLE_STEPS + 1)]
    got = graph.request_entries(g, long)
    assert got is not None and not set(got[0]) & set(PS) and wide_needs_python(_state(long, got[0]), WIDE)
    # a probe action's (gated) norm-matched steering at the tap: not served here
    gate = torch.zeros(1)
    gated = [_st(_v(2), norm_match=True, gate=gate)]
    got = graph.request_entries(g, gated, gated=True)
    assert got is not None and not set(got[0]) & set(PS) and wide_needs_python(_state(gated, got[0]), WIDE)
    # under TP the graph holds no whole-row taps (`GraphTaps.wide` is not set): the same
    g.wide = {}
    got = graph.request_entries(g, ok)
    assert got is not None and got[0] == {} and wide_needs_python(_state(ok, got[0]), WIDE)


def test_a_one_piece_row_is_an_ordinary_chain(monkeypatch):
    """d_mlp no wider than d_model: the row is one piece, its chain today's (no flags), vectors padded."""
    monkeypatch.setenv("VLLM_LENS_STEER_MB", repr(64 * 2 * 16 * 4 / (1 << 20)))
    tap, (p0,) = points.site(0, points.MLPPOST), points.mlp_piece_sites(0, 1)
    g = graph.GraphTaps([p0], 16, torch.float32, torch.device("cpu"), 8, None)
    g.wide = {tap: [(p0, 0, 12)]}
    v = torch.nn.functional.normalize(torch.randn(1, 12), dim=-1)
    got = graph.request_entries(g, [DeviceSteer({tap: 0}, v, None, 1.0, False, op=CAP, lo=-math.inf, hi=0.0)])
    assert got is not None
    g.flush_entries()
    (head, *_), ids = got[0][p0], got[1]
    assert ids == [head] and int(g.entries.op[head]) == CAP and torch.equal(g.A[head, :12], v[0])


def test_a_norm_matched_add_zero_over_the_first_piece_keeps_its_norm(monkeypatch):
    """A norm-matched add touching only neurons past the first piece (B zero over piece 0): the step's flag
    (on its head, which the kernel and twin read) still says B is used — the twin's row equals the Python
    path's. (review4: with the flag taken from piece 0's B alone every test passed, and such an add
    silently added nothing.)"""
    g = _taps(monkeypatch)
    v = torch.zeros(1, W)
    v[0, 2 * D + 1] = 1.0  # a neuron of the last piece
    steers = [_st(v, scale=0.5, norm_match=True)]
    got = graph.request_entries(g, steers)
    assert got is not None
    g.flush_entries()
    head = got[0][PS[0]][0]
    assert int(g.entries.bflag[head]) == 1
    h = torch.randn(2, W, generator=torch.Generator().manual_seed(9))
    first = g.col[PS[0]]
    for j in range(PIECES):
        g.ctl[first + j, 0, 1] = head
    g._start(frozenset(range(g.n_cols)))
    twin, ref = h.clone(), h.clone()
    g.apply(twin, None, TAP)
    steer_rows(steers, TAP, None, ref, None, 0, 1)
    assert torch.equal(twin[1], h[1])  # (row 1: no entry)
    assert (twin - ref).abs().max() <= 1e-6 and (twin[0] - h[0]).abs().max() > 0.1
