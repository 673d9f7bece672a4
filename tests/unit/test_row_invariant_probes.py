"""On CPU a request's probe scores do not depend on the batch around it, bit for bit: `projection.project`
(a row's projection, one site or several at once) and `projection.rowdot` (probe actions' per-row scores)
give a row the same bits alone as among 1, 7 or 255 others, at any offset; and through the worker's filing
— the graph-safe path (`stage_probes` / `scores_from_stage`) and the Python path (`SiteProbes.file`) — one
request's scores are the same bytes whether it runs alone or with other requests, in prefill chunks and
decode rows, naming more probes than it at its sites, and the same on both paths."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_worker.protocol import probe_wire
from vllm_worker.protocol.points import canonical_site
from vllm_worker.protocol.wire import tensor_to_bytes
from vllm_worker.worker import probes
from vllm_worker.worker.projection import project, rowdot
from vllm_worker.worker.request_results import RequestResults

D = 256
LAYERS = (2, 4)
SITES = tuple(canonical_site("resid_post", l) for l in LAYERS)


@pytest.mark.parametrize("d, n", [(64, 1), (576, 3), (4096, 16), (40000, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_projection_does_not_depend_on_the_other_rows(d, n, dtype):
    g = torch.Generator().manual_seed(d + n)
    x = torch.randn(300, d, generator=g).to(dtype)
    w = torch.randn(n, d, generator=g) / d**0.5
    full = torch.empty(300, n)
    project(x, w, full)
    for j, m in ((0, 1), (0, 2), (0, 8), (0, 256), (5, 1), (42, 7), (44, 255), (299, 1)):
        out = torch.empty(m, n)
        project(x[j : j + m], w, out)
        assert torch.equal(out, full[j : j + m]), (j, m)
    # several sites at once: each site's rows as if projected alone
    xs = torch.stack([x[:40], x[100:140]])
    ws = torch.stack([w, w.flip(0)])
    out = torch.empty(2, 40, n)
    project(xs, ws, out)
    assert torch.equal(out[0], full[:40])
    alone = torch.empty(1, n)
    project(x[100:101], w.flip(0), alone)
    assert torch.equal(out[1, :1], alone)
    # within float32 rounding of a float64 matmul (the formula), whatever the order
    ref = (x.double() @ w.double().T).float()
    assert (full - ref).abs().max() <= 1e-5 * max(1.0, float(ref.abs().max()))
    # probe actions: one (row, weight) pair a score
    pw = torch.randn(300, d, generator=g)
    pairs = rowdot(x, pw)
    for j, m in ((0, 1), (7, 1), (3, 7), (40, 255)):
        assert torch.equal(rowdot(x[j : j + m], pw[j : j + m]), pairs[j : j + m]), (j, m)


def _uses(extra: bool) -> list[probes.DeviceProbe]:
    """A request's probes on a CPU worker: 2 a site at both sites and one over both layers (`extra`: one
    more at the first site, which other requests also name)."""
    g = torch.Generator().manual_seed(7)
    wp = probes.WorkerProbes(torch.device("cpu"), frozenset(range(8)))
    specs = [("a2", [2], 2), ("b2", [2], 1), ("a4", [4], 2), ("b4", [4], 1), ("both", [2, 4], 3), ("x2", [2], 4)]
    for name, layers, n in specs:
        w = torch.randn(n, D * len(layers), generator=g) / D**0.5
        wire = {"layers": layers, "point": "resid_post", "output": "sigmoid" if n == 1 else "logit"}
        wp.load(name, name, {**wire, "weight": tensor_to_bytes(w)})
    names = [s[0] for s in specs if extra or s[0] != "x2"]
    return wp.uses([{"probe": n, "uid": n} for n in names])


def _row(site: int, key: int, pos: int) -> torch.Tensor:
    """A request's activation at a site and position: the same whatever batch it runs in."""
    g = torch.Generator().manual_seed(site * 1_000_003 + key * 10_007 + pos)
    return torch.randn(D, generator=g).to(torch.bfloat16)


def _run(path: str, n_others: int, where: int) -> bytes:
    """Request 0's scores (its payload's bytes) over a prefill composition (its 9 prompt rows; the others
    alternately prefill chunks of 13 rows and decode rows) then 3 decode steps of one composition (its one
    row a step; the others' chunks of 5 rows or decode rows), it at index `where` among `n_others` others."""
    uses, uses_o = _uses(False), _uses(True)
    reqs = [SimpleNamespace(key=k, probes=uses_o, sae=[], store=RequestResults([])) for k in range(1, n_others + 1)]
    me = SimpleNamespace(key=0, probes=uses, sae=[], store=RequestResults([]))
    reqs.insert(min(where, len(reqs)), me)
    col = {s: i for i, s in enumerate(SITES)}
    done = {r.key: (0 if r is me else 3 * r.key) for r in reqs}  # positions done so far
    for rows_me, rows_o, steps in ((9, (13, 1), 1), (1, (5, 1), 3)):
        sizes = [rows_me if r is me else rows_o[i % 2] for i, r in enumerate(reqs)]
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        items = [(r, int(bounds[i]), int(bounds[i + 1])) for i, r in enumerate(reqs)]
        n = int(bounds[-1])
        gp = SimpleNamespace(n=n, cap_rows=np.zeros(0, np.int64), cap_cols=np.zeros(0, np.int64), n_extra=0)
        gp.probes, gp.sae = {}, {}
        if path == "staged":
            all_rows = np.arange(n)
            probes.stage_probes(gp, {s: list(items) for s in SITES}, col, lambda it: all_rows)
            gp.total = len(gp.cap_rows)
        else:
            per_site = {s: probes.SiteProbes.of(s, list(items)) for s in SITES}
        for _ in range(steps):
            pos = np.concatenate([done[r.key] + np.arange(sz) for r, sz in zip(reqs, sizes)]).astype(np.int64)
            keys = np.repeat([r.key for r in reqs], sizes)
            x = {s: torch.stack([_row(s, int(k), int(p)) for k, p in zip(keys, pos)]) for s in SITES}
            if path == "staged":
                inv = {c: s for s, c in col.items()}
                stage = torch.stack([x[inv[int(c)]][int(r)] for r, c in zip(gp.cap_rows, gp.cap_cols)])
                probes.scores_from_stage(gp, torch.cat([torch.zeros(3, D, dtype=stage.dtype), stage]), 3, pos)
            else:
                for s, sp in per_site.items():
                    sp.file(x[s], pos)
            for r, sz in zip(reqs, sizes):
                done[r.key] += sz
    got = probes.payload(me.store.probes)
    assert set(got) == {u.name for u in uses}
    out = b""
    for name in sorted(got):
        positions, scores = probe_wire.arrays(got[name], name)
        assert list(positions) == list(range(12))
        out += positions.tobytes() + scores.tobytes()
    return out


@pytest.mark.parametrize("path", ["staged", "python"])
def test_a_requests_scores_are_the_same_bytes_alone_and_in_any_batch(path):
    alone = _run(path, 0, 0)
    for n_others, where in ((1, 0), (1, 1), (7, 3), (255, 0), (255, 128), (255, 255)):
        assert _run(path, n_others, where) == alone, (n_others, where)


def test_both_paths_give_the_same_bytes():
    assert _run("staged", 7, 2) == _run("python", 7, 2)
