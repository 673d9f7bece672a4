"""Whole-row edits at mlp_post on the graph path: a request's chain at the tap's own site (ablate, cap,
norm-matched add, mixed with add and set, in order) is stored as `pieces` consecutive entries per step, every
piece column of the row points at its head, and the program of piece 0 serves the whole row — steering and
the capture of every piece. Checked in Triton's interpreter (`TRITON_INTERPRET=1`, a process of its own)
against the CPU engines' torch twin (`GraphTaps._apply_torch_wide`) and the Python path (`steer_rows` on the
whole row): a narrower last piece, whole and per-value rows side by side, a flagged row's capture, idle rows
and batch-mates untouched, probe actions' gates (0: nothing added, 1: added)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from support import pythonpath

SCRIPT = textwrap.dedent(
    """
    import math, sys, torch
    from vllm_worker.protocol import points
    from vllm_worker.protocol.ops import ABLATE, ADD, CAP, SET
    from vllm_worker.worker import graph
    from vllm_worker.worker.graph_kernels import make_tap_kernel
    from vllm_worker.worker.interventions import steer_rows
    from vllm_worker.worker.plan import DeviceSteer

    dtype = getattr(torch, sys.argv[1])
    torch.manual_seed(0)
    d, n, pieces = int(sys.argv[2]), 8, 3  # d 32: an 80-wide row, pieces of 32, 32, 16 (d 24: 24, 24, 12)
    w = 2 * d + d // 2
    tap = points.site(0, points.MLPPOST)
    ps = points.mlp_piece_sites(0, pieces)
    sites = [points.site(0, points.IN), points.site(0, points.OUT), *ps]
    g = graph.GraphTaps(sites, d, dtype, torch.device("cpu"), n, None)
    g.wide = {tap: [(s, j * d, min((j + 1) * d, w)) for j, s in enumerate(ps)]}
    first = g.col[ps[0]]
    assert g.whole == {tap: ps}

    def unit(seed):
        v = torch.randn(1, w, generator=torch.Generator().manual_seed(seed))
        return (v / v.norm()).to(dtype)

    def steer(v, **kw):
        return DeviceSteer({tap: 0}, v, None, kw.pop("scale", 1.0), kw.pop("norm_match", False), **kw)

    # chain A: ablate, add, cap, norm-matched add, set of the values (keep: none) — 5 steps, every kind
    keep = torch.zeros(w)
    keep[5:70] = 1
    chain_a = [
        steer(unit(1), op=ABLATE),
        steer(unit(2) * 3, scale=1.5),
        steer(unit(3), op=CAP, lo=-0.05, hi=0.05),
        steer(unit(4), scale=0.5, norm_match=True),
        steer(unit(5) * 2, op=SET, keep=keep),
    ]
    chain_b = [steer(unit(6) * 2, scale=0.7, norm_match=True)]  # a norm-matched add alone
    # chain C: MAX_WHOLE_STEPS (8) steps, each with a scalar of its own (a projection or a norm): the kernel
    # keeps every one in registers (review4: a kernel keeping 4 passed the tests above)
    chain_c = []
    for k in range(4):
        chain_c.append(steer(unit(20 + k), op=ABLATE) if k % 2 else steer(unit(20 + k), op=CAP, lo=-0.1, hi=0.1))
        chain_c.append(steer(unit(30 + k), scale=0.3 + 0.2 * k, norm_match=True))
    got_a = graph.request_entries(g, chain_a)
    got_b = graph.request_entries(g, chain_b)
    got_c = graph.request_entries(g, chain_c)
    assert got_a is not None and got_b is not None and got_c is not None
    head_c = got_c[0][ps[0]][0]
    assert len(got_c[1]) == 8 * pieces, got_c[1]
    ent_a, ids_a = got_a
    ent_b, ids_b = got_b
    assert set(ent_a) == set(ps) and len({ent_a[p][0] for p in ps}) == 1, ent_a
    head_a, head_b = ent_a[ps[0]][0], ent_b[ps[0]][0]
    assert len(ids_a) == 5 * pieces and ids_a == list(range(ids_a[0], ids_a[0] + 5 * pieces)), ids_a
    # per-piece entries (today's layout) beside them: a cap -> add chain, and two probe actions' gated adds
    t = g.entries
    u = torch.nn.functional.normalize(torch.randn(d), dim=-1)
    per = t.add(torch.stack([u, torch.randn(d)]), torch.zeros(2, d), ops=[CAP, ADD], lo=[-0.2, -math.inf],
                hi=[0.1, math.inf], nxt=[1, -1])
    gated = t.add(torch.randn(2, d), torch.zeros(2, d), gated=True)
    g.flush_entries()
    g.gate[gated[1]] = 1.0  # the second action fired; the first did not
    ctl = g.ctl
    # row 0: per-piece chain at piece 1, capture of piece 0 | row 1: chain A, capture of every piece
    # row 2: idle | row 3: chain B, no capture | row 4: chain A, capture of the last piece only
    # row 5: gated adds at pieces 0 (gate 0) and 2 (gate 1), capture of both | row 6: capture only | row 7: chain C
    ctl[first + 1, 0, 1] = per[0]
    ctl[first, 0, 0] = 0
    for j in range(pieces):
        ctl[first + j, 1] = torch.tensor([1 + j, head_a])
        ctl[first + j, 3, 1] = head_b
        ctl[first + j, 4, 1] = head_a
        ctl[first + j, 6, 0] = 8 + j
        ctl[first + j, 7, 1] = head_c
    ctl[first + 2, 4, 0] = 4
    ctl[first, 5] = torch.tensor([5, gated[0]])
    ctl[first + 2, 5] = torch.tensor([6, gated[1]])
    g.base.fill_(2)
    h = (torch.randn(n, w) * 2).to(dtype)
    stage0 = torch.full(tuple(g.stage.shape), float("nan"), dtype=dtype)

    # the kernel (interpreter), one launch over (rows, pieces)
    k = make_tap_kernel()
    h1, s1 = h.clone(), stage0.clone()
    k[(n, pieces)](h1, h1, ctl, g.base, s1, g.A, g.B, g.bflag, g.gate, g.op, g.nxt, g.lo, g.hi, first, n, d, w,
        h1.stride(0), h1.stride(0), HAS_R=False, WIDE=True, BLOCK=g._block)
    # the torch twin (CPU engines)
    h2 = h.clone()
    g.stage.copy_(stage0)
    g._start(frozenset(range(g.n_cols)))
    g.apply(h2, None, tap)
    s2 = g.stage.clone()
    # the Python path: the request's steering on the whole row, float32 throughout, rounded once
    h3 = h.clone()
    for rows, chain in (((1, 2), chain_a), ((3, 4), chain_b), ((4, 5), chain_a), ((7, 8), chain_c)):
        steer_rows(chain, tap, None, h3, None, *rows)

    untouched = [2, 6]
    assert all(torch.equal(h1[r], h[r]) for r in untouched)
    assert torch.equal(h1[5, :d], h[5, :d]) and not torch.equal(h1[5, 2 * d :], h[5, 2 * d :])  # gate 0 / 1
    whole = [1, 3, 4, 7]
    f = lambda x: x.float()
    print("KERNEL_TWIN", float((f(h1) - f(h2)).abs().max()), float((f(s1) - f(s2)).nan_to_num(0).abs().max()))
    print("KERNEL_PY", float((f(h1[whole]) - f(h3[whole])).abs().max()))
    def ulps(x, ref):  # |x - ref| in units of the model dtype's step at the row's largest value
        top = f(ref).abs().amax(dim=1, keepdim=True)
        step = torch.exp2(torch.floor(torch.log2(top)) + math.log2(torch.finfo(dtype).eps))
        return ((f(x) - f(ref)).abs() / step).max()

    print("DIFFER", int((h1[whole] != h3[whole]).sum()), h1[whole].numel(), float(ulps(h1[whole], h3[whole])),
        float(ulps(h1[whole], h2[whole])))
    # what was captured: the edited rows, every piece of row 1, the last piece of row 4, both of row 5
    for r, j, slot in [(1, 0, 1), (1, 1, 2), (1, 2, 3), (4, 2, 4), (0, 0, 0), (5, 0, 5), (5, 2, 6), (6, 1, 9)]:
        width = min(d, w - j * d)
        assert torch.equal(s1[slot + 2, :width], h1[r, j * d : j * d + width]), (r, j)
    assert int((~torch.isnan(f(s1)).all(1)).sum()) == 10
    # chain A really ran: its last step (set) wrote unit(5) * 2 where keep is 0
    assert torch.allclose(f(h1[1, :5]), f(unit(5)[0, :5] * 2), atol=1e-2)
    print("OK")
    """
)


def _run(dtype: str, d: int = 32) -> dict[str, list[str]]:
    pytest.importorskip("triton")
    env = {"TRITON_INTERPRET": "1", "PYTHONPATH": pythonpath(None)}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, dtype, str(d)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines() if line.strip()}
    assert "OK" in out, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out


@pytest.mark.parametrize("d", [32, 24], ids=["d32", "d24-not-a-power-of-2"])
def test_whole_row_chains_in_the_kernel_equal_the_twin_and_the_python_path_fp32(d):
    """(d 24: a block of 32, read in halves of 16 — the second half of a piece partly masked, the last
    piece, 12 wide, inside the first half.)"""
    out = _run("float32", d)
    assert all(float(x) <= 1e-5 for x in out["KERNEL_TWIN"]), out
    assert float(out["KERNEL_PY"][0]) <= 1e-5, out


def test_whole_row_chains_in_bf16_round_once_like_the_python_path():
    """bf16 rows and entries: the kernel and the Python path both compute in float32 and round once; only
    the order of the sums over the row differs (piece by piece vs torch's), so a value may land one bf16
    step away, never more."""
    out = _run("bfloat16")
    differ, total, vs_py, vs_twin = int(out["DIFFER"][0]), int(out["DIFFER"][1]), *map(float, out["DIFFER"][2:])
    print("bf16: values differing from the Python path", differ, "of", total, "; max steps", vs_py, vs_twin)
    assert vs_twin <= 1, out
    assert vs_py <= 2, out
