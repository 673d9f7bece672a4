"""`probes.StagedProbes`: on the graph-safe path the probe sites of a composition with as many rows and
columns are scored by one batched projection a step into one record (their rows one site after another);
every request's scores equal one projection per site (the Python path's `SiteProbes.file`, the layout
before) bit for bit on CPU (a row's projection does not depend on the others: `worker/projection`), and
positions exactly, whether the sites' slots are consecutive (a slice of the ring) or some are lent by
captures (a gather), and sites of other shapes get groups of their own."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_worker.protocol import probe_wire
from vllm_worker.protocol.points import canonical_site
from vllm_worker.protocol.wire import tensor_to_bytes
from vllm_worker.worker import probes
from vllm_worker.worker.request_results import RequestResults

D, N = 16, 6  # row width, batch rows (one per request)
LAYERS = (2, 4, 6, 8)


def site(layer: int) -> int:
    return canonical_site("resid_post", layer)


SITES = tuple(site(l) for l in LAYERS)


def _uses(n_cols: dict[int, list[int]]) -> list[probes.DeviceProbe]:
    """Probes "p<site>_<j>" of `n_cols[site][j]` outputs, loaded on a CPU worker."""
    g = torch.Generator().manual_seed(5)
    wp = probes.WorkerProbes(torch.device("cpu"), frozenset(range(16)))
    names = []
    for layer, cols in n_cols.items():
        for j, c in enumerate(cols):
            name = f"p{layer}_{j}"
            wire = {"layers": [layer], "point": "resid_post", "output": "sigmoid" if j else "logit"}
            wp.load(name, name, {**wire, "weight": tensor_to_bytes(torch.randn(c, D, generator=g))})
            names.append(name)
    return wp.uses([{"probe": n, "uid": n} for n in names])


def _requests(uses: list) -> list[SimpleNamespace]:
    return [SimpleNamespace(probes=uses, sae=[], store=RequestResults([])) for _ in range(N)]


def _rows(items: list) -> np.ndarray:
    return np.concatenate([np.arange(s, e) for _, s, e in items])


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def _run(
    uses: list, captured: dict[int, np.ndarray], steps: int = 5, still: bool = False, ops: list | None = None
) -> tuple[list, list, dict]:
    """The same rows scored both ways: staged (`stage_probes` on a plan whose captures lend `captured`'s
    rows at their sites, then `scores_from_stage`) and per site (`SiteProbes.file`); both sets' requests.
    `still`: one ring whose base stays (steps that copy nothing out: `StagingRing.alloc`), else the base
    moves; `ops`: each step's aten ops in `scores_from_stage`, appended."""
    sites = sorted({s for u in uses for s in u.weights})
    col = {s: i for i, s in enumerate(sites)}
    cap_rows = np.concatenate([captured.get(s, np.zeros(0, np.int64)) for s in sites]).astype(np.int64)
    cap_cols = np.concatenate([np.full(len(captured.get(s, ())), col[s]) for s in sites]).astype(np.int64)
    gp = SimpleNamespace(n=N, cap_rows=cap_rows, cap_cols=cap_cols, n_extra=0, probes={}, sae={})
    staged, alone = _requests(uses), _requests(uses)
    probes.stage_probes(gp, {s: [(r, i, i + 1) for i, r in enumerate(staged)] for s in sites}, col, _rows)
    gp.total = len(gp.cap_rows)
    per_site = {s: probes.SiteProbes.of(s, [(r, i, i + 1) for i, r in enumerate(alone)]) for s in sites}
    g = torch.Generator().manual_seed(6)
    inv = {c: s for s, c in col.items()}
    still_ring = torch.zeros(3 + len(gp.cap_rows) + 2, D, dtype=torch.bfloat16)
    for k in range(steps):
        x = {s: torch.randn(N, D, generator=g).to(torch.bfloat16) for s in sites}  # the site's rows this step
        stage = torch.stack([x[inv[int(c)]][int(r)] for r, c in zip(gp.cap_rows, gp.cap_cols)])
        base = 3 if still else 3 * (k % 2)  # the ring's base moves from step to step, or stays
        ring = still_ring if still else torch.zeros(base + len(stage) + 2, D, dtype=torch.bfloat16)
        ring[base : base + len(stage)] = stage
        pos = np.arange(N, dtype=np.int64) * 10 + k
        with _Ops() as counted:
            probes.scores_from_stage(gp, ring, base, pos)
        if ops is not None:
            ops.append(counted.names)
        for s, sp in per_site.items():
            sp.file(x[s], pos)
    return staged, alone, gp.probes


def _same(staged: list, alone: list) -> None:
    """Positions and scores equal, bit for bit (on CPU a row's projection does not depend on the rows
    projected with it, nor on the sites projected at once: `projection.project`)."""
    for a, b in zip(staged, alone):
        got, want = probes.payload(a.store.probes), probes.payload(b.store.probes)
        assert set(got) == set(want) == {u.name for u in a.probes}
        for name in got:
            assert got[name]["positions"] == want[name]["positions"]
            g, w = (torch.from_numpy(probe_wire.arrays(x[name], name)[1].copy()) for x in (got, want))
            assert g.shape == w.shape and torch.equal(g, w), (name, (g - w).abs().max())


def test_sites_alike_share_one_batched_projection_a_step_with_the_same_scores():
    uses = _uses({l: [1, 2] for l in LAYERS})  # W10's shape: 2 probes at each of 4 sites
    before = dict(probes.PROBE_COUNTS)
    staged, alone, groups = _run(uses, {})
    assert list(groups) == [SITES]  # one group, ...
    (group,) = groups.values()
    assert group.first == 0 and group.dev_slots is None  # ... its rows one slice of the ring
    assert group.weight.shape == (4, 3, D)
    # 5 steps: one projection each staged, one per site and step alone
    assert probes.PROBE_COUNTS["projections"] - before["projections"] == 5 + 4 * 5
    records = {id(sp.record) for r in staged for p in r.store.probes.values() for v in p.spans.values() for sp in v}
    assert len(records) == 1
    _same(staged, alone)


def test_lent_slots_and_sites_of_other_shapes():
    uses = _uses({2: [1, 2], 4: [3], 6: [2, 1], 8: [1]})  # columns 3, 3, 3, 1: two groups
    # requests capturing rows at sites 4 and 6 lend them: those groups gather their rows
    staged, alone, groups = _run(uses, {site(4): np.array([1, 3]), site(6): np.array([0, 1, 2, 3, 4, 5])})
    three, one = (site(2), site(4), site(6)), (site(8),)
    assert list(groups) == [three, one]
    assert groups[three].first is None and groups[three].dev_slots is not None
    assert groups[one].first is not None
    _same(staged, alone)


def test_one_site_is_one_plain_projection():
    uses = _uses({4: [2]})
    staged, alone, groups = _run(uses, {})
    assert list(groups) == [(site(4),)] and groups[(site(4),)].weight.shape == (2, D)
    _same(staged, alone)


def test_a_step_at_the_same_base_dispatches_only_the_projection():
    """Steps whose ring base stays (nothing copied out) reuse the staged rows' view, the weights' views and
    the record's views of the step (made with its chunk: chunks of 1, 2, 4 ... steps): such a step dispatches
    the projection's own ops only (on CPU a product and a sum; no view, slice or position copy through
    torch), with the scores of one projection per site, bit for bit."""
    for n_cols in ({l: [1, 2] for l in LAYERS}, {4: [2]}):
        ops: list = []
        staged, alone, groups = _run(_uses(n_cols), {}, steps=7, still=True, ops=ops)
        (group,) = groups.values()
        assert group.first == 0
        for k in (2, 4, 5, 6):  # steps inside a chunk (steps 0, 1 and 3 open one)
            assert ops[k] == ["unsqueeze", "mul", "sum"], (k, ops[k])
        _same(staged, alone)
