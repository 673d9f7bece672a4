"""One launch of the Triton tap kernel over every d_model-wide piece of an mlp_post row (grid: rows x pieces)
writes exactly what one launch per piece wrote — the same bytes in the row and in the staging ring,
a narrower last piece included — and what the CPU engines' torch twin computes. Checked in Triton's
interpreter (`TRITON_INTERPRET=1`, a process of its own: the flag is read when kernels are made)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from support import pythonpath

SCRIPT = textwrap.dedent(
    """
    import math, torch
    from vllm_worker.worker.graph_entries import SteeringEntries
    from vllm_worker.worker.graph_kernels import make_tap_kernel
    from vllm_worker.worker.interventions import apply_entries

    torch.manual_seed(0)
    d, n, pieces, first = 32, 6, 3, 2  # an 80-wide row: pieces of 32, 32, 16; their columns 2, 3, 4
    w = 2 * d + d // 2
    t = SteeringEntries(16, d, torch.float32, torch.device("cpu"))
    u = torch.nn.functional.normalize(torch.randn(d), dim=-1)
    a = torch.stack([torch.randn(d), u, torch.randn(d)])
    b = torch.stack([torch.randn(d) / 10, torch.zeros(d), torch.zeros(d)])
    norm = t.add(a[:1], b[:1])  # a norm-matched addition
    chain = t.add(a[1:], b[1:], ops=[2, 0], lo=[-0.2, -math.inf], hi=[0.1, math.inf], nxt=[1, -1])  # cap, add
    t.flush()
    k = make_tap_kernel()
    cols = 6
    ctl = torch.full((cols, n, 2), -1, dtype=torch.int32)
    # piece 0: capture rows 0-2, steer row 1; piece 1: steer rows 0 and 4 (chain), capture row 5;
    # piece 2 (narrower): capture and steer row 3; row 2 of pieces 1 and 2 and column 5 idle
    ctl[first, 0:3, 0] = torch.tensor([0, 1, 2], dtype=torch.int32)
    ctl[first, 1, 1] = norm[0]
    ctl[first + 1, 0, 1] = chain[0]
    ctl[first + 1, 4, 1] = chain[0]
    ctl[first + 1, 5, 0] = 3
    ctl[first + 2, 3, 0] = 4
    ctl[first + 2, 3, 1] = norm[0]
    base = torch.tensor([7], dtype=torch.int32)
    h = torch.randn(n, w)
    stage = torch.full((16, d), float("nan"))

    def launch(x, col, grid_pieces):
        st = stage.clone()
        k[(n, grid_pieces)](x, x, ctl, base, st, t.A, t.B, t.bflag, t.gate, t.op, t.nxt, t.lo,
            t.hi, col, n, d, x.shape[1], x.stride(0), x.stride(0), HAS_R=False, BLOCK=d)
        return st

    h1 = h.clone()
    s1 = launch(h1, first, pieces)  # one launch, every piece
    h2, s2 = h.clone(), stage.clone()
    for j in range(pieces):  # one launch per piece (a view of the row: what the graph path did before)
        sj = launch(h2[:, j * d : min((j + 1) * d, w)], first + j, 1)
        got = ~torch.isnan(sj).all(1)
        s2[got] = sj[got]
    h3, s3 = h.clone(), stage.clone()
    for j in range(pieces):  # the torch twin (CPU engines: `GraphTaps._apply_torch`)
        x = h3[:, j * d : min((j + 1) * d, w)]
        c = ctl[first + j]
        rows = torch.nonzero(c[:, 1] >= 0).squeeze(1)
        apply_entries(x, None, rows, c[rows, 1], t)
        rows = torch.nonzero(c[:, 0] >= 0).squeeze(1)
        s3[c[rows, 0].long() + 7, : x.shape[1]] = x[rows]
    assert not torch.equal(h1, h) and torch.equal(h1[2], h[2])  # steered; row 2 untouched
    same = torch.equal(h1, h2) and torch.equal(s1.nan_to_num(-9), s2.nan_to_num(-9))
    captured = ~torch.isnan(s1).all(1)
    assert captured.sum() == 5, captured
    print("BITWISE", same)
    print("MAXDIFF", float(max((h1 - h3).abs().max(), (s1[captured] - s3[captured]).nan_to_num(0).abs().max())))
    """
)


def test_one_launch_over_the_pieces_equals_one_per_piece():
    pytest.importorskip("triton")
    env = {"TRITON_INTERPRET": "1", "PYTHONPATH": pythonpath(None)}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )
    out = proc.stdout.splitlines()
    assert "BITWISE True" in out, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = [x for x in out if x.startswith("MAXDIFF")]
    assert line and float(line[0].split()[1]) <= 1e-5, proc.stdout[-2000:]


class _Grids:
    """Stands in for the Triton kernel: records each launch's grid and column."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, int]] = []

    def __getitem__(self, grid: tuple):
        def run(*args, **kwargs):
            self.calls.append((grid, args[13]))  # (grid, col)

        return run


def test_an_mlp_post_tap_launches_once_in_a_step_and_idle_not_at_all():
    """Where the kernel runs (a recorded graph, or a step using the tap's columns) an mlp_post tap is one
    launch over (rows, pieces) from its first piece's column; outside a step, or in a step using none of its
    columns, none; a row whose pieces' columns are not consecutive keeps one launch per piece."""
    import torch

    from vllm_worker.protocol import points
    from vllm_worker.worker import graph

    d, d_mlp = 8, 20  # pieces of 8, 8, 4
    tap0, tap1 = points.site(0, points.MLPPOST), points.site(1, points.MLPPOST)
    p0, p1 = points.mlp_piece_sites(0, 3), points.mlp_piece_sites(1, 3)
    out0 = points.site(0, points.OUT)
    sites = sorted([points.site(0, points.IN), out0, *p0, *p1[:2], points.site(1, points.OUT), p1[2]])
    g = graph.GraphTaps(sites, d, torch.float32, torch.device("cpu"), 16, None)
    k = _Grids()
    g._kernel = k
    wide = {t: [(s, j * d, min((j + 1) * d, d_mlp)) for j, s in enumerate(ps)] for t, ps in ((tap0, p0), (tap1, p1))}
    g.wide = wide
    # layer 1's last piece moved to a column not next to its other pieces': a launch per piece there
    g.col[p1[2]] = g.n_cols
    g.wide = wide
    x = torch.zeros(5, d_mlp)
    g.apply(x, None, tap0)
    assert k.calls == []  # idle: no step running
    g._start(frozenset({g.col[out0]}))
    g.apply(x, None, tap0)
    assert k.calls == []  # a step that uses none of the tap's columns
    g._start(frozenset({g.col[p0[1]]}))
    g.apply(x, None, tap0)
    assert k.calls == [((5, 3), g.col[p0[0]])]
    k.calls.clear()
    g._start(frozenset(g.col.values()))
    g.apply(x, None, tap1)
    assert k.calls == [((5, 1), g.col[p1[0]]), ((5, 1), g.col[p1[1]]), ((5, 1), g.col[p1[2]])]
