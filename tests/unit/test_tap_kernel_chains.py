"""The Triton tap kernel (what CUDA graphs replay) walks chains of entries — add, ablate, cap, set, in
order — exactly like its torch twin that CPU engines run (`interventions.apply_entries`), checked in
Triton's interpreter (`TRITON_INTERPRET=1`, a process of its own: the flag is read when kernels are made).
The twin itself is checked against HF by tests/core/test_interventions.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from support import pythonpath

SCRIPT = textwrap.dedent(
    """
    import math, os, torch
    from vllm_worker.worker.graph_entries import SteeringEntries
    from vllm_worker.worker.graph_kernels import make_tap_kernel
    from vllm_worker.worker.interventions import apply_entries

    torch.manual_seed(0)
    d, n = 48, 8
    t = SteeringEntries(32, d, torch.float32, torch.device("cpu"))
    u = torch.nn.functional.normalize(torch.randn(2, d), dim=-1)
    a = torch.stack([torch.randn(d), u[0], u[1], torch.randn(d), torch.randn(d)])
    keep = (torch.rand(d) > 0.5).float()
    b = torch.stack([torch.zeros(d), torch.zeros(d), torch.zeros(d), keep, torch.randn(d) / 10])
    inf = math.inf
    chain = t.add(a, b, ops=[0, 1, 2, 3, 0], lo=[-inf, -inf, -0.5, -inf, -inf], hi=[inf, inf, 0.3, inf, inf],
                  nxt=[1, 2, 3, 4, -1])
    single = t.add(a[:1], b[4:5])  # a plain norm-matched addition, as every steering entry before ops
    gated = t.add(a[3:4], b[:1], gated=True)  # a probe action's addition, before it fired (gate 0)
    t.flush()
    k = make_tap_kernel()
    worst = 0.0
    for has_r in (False, True):
        h = torch.randn(n, d)
        r = torch.randn(n, d) if has_r else None
        ent = torch.tensor([chain[0], -1, chain[1], chain[2], single[0], chain[4], chain[3], gated[0]], dtype=torch.int32)
        ctl = torch.full((1, n, 2), -1, dtype=torch.int32)
        ctl[0, :, 1] = ent
        h1, h2 = h.clone(), h.clone()
        rr = h1 if r is None else r
        k[(n,)](h1, rr, ctl, torch.zeros(1, dtype=torch.int32), torch.zeros(1, d), t.A, t.B, t.bflag, t.gate, t.op,
                t.nxt, t.lo, t.hi, 0, n, d, d, h1.stride(0), rr.stride(0), HAS_R=r is not None, BLOCK=64)
        rows = torch.nonzero(ent >= 0).squeeze(1)
        apply_entries(h2, r, rows, ent[rows], t)
        assert torch.equal(h1[1], h[1])  # a row without an entry is untouched
        assert torch.equal(h1[7], h[7]) and torch.equal(h2[7], h[7])  # a gate at 0: no addition
        assert (h1 - h).abs().max() > 1.0
        worst = max(worst, float((h1 - h2).abs().max()))
    print("MAXDIFF", worst)
    """
)


def test_kernel_chains_equal_the_torch_twin():
    pytest.importorskip("triton")
    env = {"TRITON_INTERPRET": "1", "PYTHONPATH": pythonpath(None)}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )
    line = [l for l in proc.stdout.splitlines() if l.startswith("MAXDIFF")]
    assert line, proc.stderr[-3000:]
    assert float(line[0].split()[1]) <= 1e-5
