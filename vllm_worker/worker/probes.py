"""Probes in a worker: loaded on the device (`lens_load_probe`), turned into per-request uses at admission,
and scored each step on the rows of the requests that name them, as SAE features are (`worker/saes`).

- Graph-safe path: the kernel stages the rows at each probe's site with the step's captures (a request
  capturing the site lends its capture slots; the others get slots after every other staged row:
  `stage_probes`); after the step they are projected there, on the device (`scores_from_stage`).
- Python path: projected from the rows at the tap (`scores_at`).

Either way one projection per site (`projection.project`: on CPU a row's scores do not depend on the other
rows) serves every request and probe of the step, written into the batch composition's record for that site
(`SiteProbes`, `step_records`): a step's host work does not grow with requests or probes. On the graph-safe
path sites alike in rows and columns share one batched projection and one record (`StagedProbes`): nor
does it grow with sites. A multi-layer probe is a sum of one projection per layer (mean / std folded into the
weights: `Probe.folded`); the per-site parts are added, the bias added and the sigmoid applied when the
request's scores are fetched (`payload`). Scores wait on the device (n_out floats a token) until then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_worker import compat
from vllm_worker.probes.format import Probe, check_probe
from vllm_worker.protocol import probe_wire
from vllm_worker.protocol.points import canonical_site
from vllm_worker.protocol.wire import tensor_from_bytes
from vllm_worker.worker import projection
from vllm_worker.worker.device_copy import to_device
from vllm_worker.worker.probe_filing import Filed, ProbeScores
from vllm_worker.worker.projection import project
from vllm_worker.worker.step_records import Span, StepRecord, latest_order
from vllm_worker.worker.stream_rows import stream_rows

PROBE_COUNTS = {"rows": 0, "projections": 0}  # rows this process scored, projections it ran (tests, benchmarks)


@dataclass(eq=False)
class DeviceProbe:
    name: str
    uid: str
    weights: dict[int, torch.Tensor]  # site -> (n_out, d) float32 on the device, mean / std folded in
    bias: torch.Tensor  # (n_out,) float32 on the host, mean folded in
    sigmoid: bool
    sites: list[int]  # every site the probe reads (all on this stage: `frontend.probes.check_local`)


class WorkerProbes:
    """This worker's probes by name (`None` weights: another pipeline stage holds the probe's layers)."""

    def __init__(self, device: torch.device, local_layers: frozenset) -> None:
        self.device, self.local_layers = device, local_layers
        self.loaded: dict[str, DeviceProbe] = {}
        self.version = 0  # counts loads and deletes: what was derived from `loaded` is stale once it moves
        # once a worker (vLLM turned its batch-invariant mode on, or not, before the model loaded): GPU scores
        # (these probes' and probe actions') then go through the ops the mode replaces
        projection.use_batch_invariant(device.type == "cuda" and compat.batch_invariant_mode())

    def load(self, name: str, uid: str, wire: dict[str, Any]) -> dict[str, Any]:
        parts = {k: None if wire.get(k) is None else tensor_from_bytes(wire[k], f"probe.{k}") for k in _TENSORS}
        p: Probe = check_probe(
            layers=list(wire["layers"]), point=str(wire["point"]), output=str(wire["output"]), **parts
        )
        local = [l for l in p.layers if l in self.local_layers]
        sites = [canonical_site(p.point, l) for l in p.layers]
        weights: dict[int, torch.Tensor] = {}
        ws, bias = p.folded()
        if len(local) == len(p.layers):
            weights = {s: w.to(self.device) for s, w in zip(sites, ws)}
        _STACKS.clear()
        self.version += 1
        self.loaded[name] = DeviceProbe(name, uid, weights, bias, p.output == "sigmoid", sites)
        return {"name": name, "local_layers": local}

    def delete(self, name: str) -> bool:
        _STACKS.clear()
        self.version += 1
        return self.loaded.pop(name, None) is not None

    def uses(self, entries: list[dict[str, Any]]) -> list[DeviceProbe]:
        """A request's `RequestSpec.probes` entries as this stage's probes (those whose layers it holds)."""
        out = []
        for u in entries:
            got = self.loaded.get(u["probe"])
            if got is None:
                raise ValueError(f"probe {u['probe']!r} is not loaded in this worker")
            if got.uid != u["uid"]:
                raise ValueError(f"probe {u['probe']!r} was replaced while this request was on its way; send it again")
            if got.weights:
                out.append(got)
        return out


_TENSORS = ("weight", "bias", "mean", "std")


class SiteProbes:
    """The requests scored at one site in a batch composition, the stacked weights of their probes, and the
    record their scores go to (`step_records`): made at the composition's first step, with each request's
    spans (its rows, its probes' columns) — after that a step is one projection into the record."""

    def __init__(self, site: int, items: list, weight: torch.Tensor, cols: dict, key: tuple = ()) -> None:
        self.site, self.items, self.weight = site, items, weight
        self.key = key  # (site, its probes' ids): `_STACKS`' key of `weight`
        self.cols: dict[tuple[str, str], tuple[int, int]] = cols  # (name, uid) -> its columns
        self.record: StepRecord | None = None  # (Python path)

    @classmethod
    def of(cls, site: int, items: list) -> "SiteProbes":
        used: dict[tuple[str, str], DeviceProbe] = {}
        seen: set[tuple] = set()  # the requests' probe lists, each walked once (often all alike)
        for r, _, _ in items:
            ps = tuple(r.probes)
            if ps in seen:
                continue
            seen.add(ps)
            for u in ps:
                if site in u.weights:
                    used.setdefault((u.name, u.uid), u)
        cols, c = {}, 0
        for key, u in used.items():
            n = u.weights[site].shape[0]
            cols[key] = (c, c + n)
            c += n
        stack_key = (site, *(id(u) for u in used.values()))
        return cls(site, items, _stacked(stack_key, tuple(used.values())), cols, stack_key)

    def file(self, x: torch.Tensor, pos: np.ndarray | torch.Tensor) -> None:
        """Python path: project rows `x` (the rows of `items`, in order) on every probe of the site at once,
        into this step's row of the record."""
        rec = self.record
        if rec is None:
            rec = self.record = StepRecord(self.rows, {"scores": (self.weight.shape[0], torch.float32)}, x.device)
            self.spans(rec, 0)
        out = rec.next(pos)["scores"]
        project(x, self.weight, out)
        PROBE_COUNTS["rows"] += x.shape[0]
        PROBE_COUNTS["projections"] += 1

    @property
    def rows(self) -> int:
        return sum(e - s for _, s, e in self.items)

    def spans(self, rec: StepRecord, row0: int) -> None:
        """File each request's rows of `rec` (this site's from `row0` on) once per composition: one entry
        a request (`probe_filing`), its spans made from it when read."""
        where = Filed(rec, self.site, self.cols)
        off = row0
        for r, s, e in self.items:
            if r.store is not None:
                r.store.probe_filed.append((where, off, e - s, r.probes))
            off += e - s


class StagedProbes:
    """Graph-safe path: the probe sites of a composition with as many rows and columns each, scored together
    — one batched projection a step for all of them ((sites, rows, d) x (sites, d, columns)) into one record
    whose rows are the sites' rows one site after another: a step's launches do not grow with sites. Their
    staged rows are one slice of the ring when `stage_probes` gave them consecutive slots (no gather)."""

    def __init__(self, parts: list[SiteProbes], slots: np.ndarray, rows: np.ndarray) -> None:
        self.parts, self.slots = parts, slots
        self.rows = rows  # the batch row of each record row (for the step's positions)
        n = len(slots)
        self.first: int | None = int(slots[0]) if n and np.array_equal(slots, slots[0] + np.arange(n)) else None
        self.dev_slots: torch.Tensor | None = None  # (slots not consecutive) on the device, once
        self.weight = _stacked_sites(parts)  # (cols, d) for one site; (sites, cols, d) for several
        self.views = projection.weight_views(self.weight)  # its views `project` takes, made once
        self.record: StepRecord | None = None
        # (stage, base, the staged rows as projected): the view a step at the same base reuses (consecutive
        # slots; the ring keeps its base over steps that copy nothing out: `StagingRing.alloc`)
        self._x: tuple[torch.Tensor, int, torch.Tensor] | None = None

    def file(self, stage: torch.Tensor, base: int, total: int, positions: np.ndarray) -> None:
        """This step's scores of every part's staged rows (ring rows from `base`; `total` staged a step)."""
        several = len(self.parts) > 1
        got = self._x
        if got is not None and got[0] is stage and got[1] == base:
            x = got[2]
        else:
            if self.first is not None:
                x = stage.narrow(0, base + self.first, len(self.slots))
            else:
                if self.dev_slots is None:  # once per composition: a step only moves the ring's base
                    self.dev_slots = to_device(torch.from_numpy(self.slots), stage.device)
                x = stage.narrow(0, base, total).index_select(0, self.dev_slots)
            if several:
                x = x.view(len(self.parts), -1, x.shape[-1])
            if self.first is not None:
                self._x = (stage, base, x)
        rec = self.record
        if rec is None:
            rec = self.record = self._open(stage.device)
        out = rec.next(positions[self.rows])["scores"]  # ((sites, rows, columns) for several: `_open`)
        project(x, self.weight, out, views=self.views)
        if x.is_cuda:  # (an idle step may read the record while a later step runs: `ready_probes`)
            rec.mark()
        PROBE_COUNTS["rows"] += len(self.rows)
        PROBE_COUNTS["projections"] += 1

    def _open(self, device: torch.device) -> StepRecord:
        """The composition's record, and each request's spans of it at each site (once per composition)."""
        cols = self.parts[0].weight.shape[0]
        rec = StepRecord(len(self.rows), {"scores": (cols, torch.float32)}, device, len(self.parts))
        row0 = 0
        for sp in self.parts:
            sp.spans(rec, row0)
            row0 += sp.rows
        return rec


# stacked weights by (site, probes): a batch composition changing (requests joining, leaving) mostly keeps
# the same probes; cleared when a probe is loaded or deleted
_STACKS: dict[tuple, torch.Tensor] = {}
_MAX_STACKS = 64


def _stacked(key: tuple, used: tuple[DeviceProbe, ...]) -> torch.Tensor:
    site = key[0]
    w = _STACKS.get(key)
    if w is None:
        if len(_STACKS) >= _MAX_STACKS:
            _STACKS.clear()
        w = _STACKS[key] = torch.cat([u.weights[site] for u in used]) if len(used) > 1 else used[0].weights[site]
    return w


def _stacked_sites(parts: list[SiteProbes]) -> torch.Tensor:
    """The parts' weights as `StagedProbes.file` projects on them: one site's (cols, d); several sites'
    (sites, cols, d), stacked once per set of sites and probes."""
    if len(parts) == 1:
        return parts[0].weight
    key = ("sites", *(sp.key for sp in parts))
    w = _STACKS.get(key)
    if w is None:
        if len(_STACKS) >= _MAX_STACKS:
            _STACKS.clear()
        w = _STACKS[key] = torch.stack([sp.weight for sp in parts])
    return w


# ---------------------------------------------------------------- per step


def scores_at(site: int, plan: Any, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
    """Python path, at a tap (after the site's edits, as captures): scores of the rows there."""
    got = plan.probe_rows.get(site)
    if got is None:
        return
    idx, sp = got
    sp.file(stream_rows(hidden, residual, idx), plan.positions.index_select(0, idx))


def scores_from_stage(gp: Any, stage: torch.Tensor, base: int, positions: np.ndarray) -> None:
    """Graph-safe path, after the step: scores of the rows the kernel staged for them (on the device,
    before the ring is reused: later steps' kernels come after these on the same stream)."""
    for group in gp.probes.values():
        group.file(stage, base, gp.total, positions)


def stage_probes(gp: Any, probe_rows: dict, col: dict[int, int], rows_of: Any) -> None:
    """Graph-safe plan: the rows each probe site reads, staged by the kernel. A row already staged at that
    site (a capture, an SAE's) lends its slot — a row has one slot per site in the table; the others get
    slots after everything staged so far (`gp.n_extra`: never copied to the host). Sites with as many rows
    and columns are scored together (`StagedProbes`), their slots consecutive when none was lent."""
    if not probe_rows:
        return
    width = gp.n + 1
    keys = gp.cap_cols.astype(np.int64) * width + gp.cap_rows
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    total = len(keys)
    extra_rows, extra_cols = [gp.cap_rows], [gp.cap_cols]
    shapes: dict[tuple[int, int], list] = {}  # (rows, columns) -> [(slots, rows, SiteProbes)] of its sites
    for site, items in probe_rows.items():
        rows = rows_of(items)
        c = col[site]
        want = c * width + rows
        i = np.minimum(np.searchsorted(sorted_keys, want), max(len(sorted_keys) - 1, 0))
        found = sorted_keys[i] == want if len(sorted_keys) else np.zeros(len(want), dtype=bool)
        slots = np.where(found, order[i] if len(order) else 0, -1).astype(np.int64)
        new = ~found
        k = int(new.sum())
        slots[new] = total + np.arange(k)
        total += k
        extra_rows.append(rows[new])
        extra_cols.append(np.full(k, c))
        sp = SiteProbes.of(site, items)
        shapes.setdefault((len(rows), sp.weight.shape[0]), []).append((slots, rows, sp))
    for parts in shapes.values():
        slots = np.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        rows = np.concatenate([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        gp.probes[tuple(p[2].site for p in parts)] = StagedProbes([p[2] for p in parts], slots, rows)
    added = total - len(keys)
    gp.cap_rows = np.concatenate(extra_rows).astype(np.int64)
    gp.cap_cols = np.concatenate(extra_cols).astype(np.int64)
    gp.n_extra += added


# ---------------------------------------------------------------- fetch


def _since(positions: list[np.ndarray], start: int) -> int:
    """Index of the first piece to read: the latest pieces, back to the first one reaching below position
    `start` (pieces come in step order)."""
    if start <= 0:
        return 0
    i = len(positions)
    while i > 0:
        i -= 1
        p = positions[i]
        if len(p) and int(p.min()) < start:
            break
    return i


@dataclass(eq=False)
class _Rows:
    """A request's positions at one site (shared by its probes there: the same rows of the same records):
    which of its spans to read, the positions, the row order that sorts them and keeps a position filed
    twice once (None: already in order) and their bytes."""

    first: int
    pos: np.ndarray
    order: np.ndarray | None
    wire: bytes


def _rows(spans: list[Span], cache: dict, start: int, running: bool) -> _Rows | None:
    """The positions of `spans`, as `step_records.latest_order` orders them (None: nothing scored)."""
    got = [(i, p) for i, sp in enumerate(spans) if (p := sp.host_positions(cache)) is not None]
    first = _since([p for _, p in got], start)
    got = got[first:]
    if not got:
        return None
    pos = np.concatenate([p for _, p in got]) if len(got) > 1 else got[0][1]
    order = latest_order(pos)  # (a recompute: sorted, the last one kept)
    if running:
        kept = (pos if order is None else pos[order]) >= start
        if not kept.all():
            order = np.flatnonzero(kept) if order is None else order[kept]
    if order is not None:
        pos = pos[order]
    return _Rows(got[0][0], pos, order, np.ascontiguousarray(pos, dtype=np.int64).tobytes())


def payload(
    got: dict[str, ProbeScores], start: int = 0, running: bool = False, cache: dict | None = None
) -> dict[str, dict[str, Any]]:
    """A request's scores as bytes, per probe (`protocol.probe_wire`: (n,) int64 positions, (n, n_out) float32) —
    the layers' parts added, then the bias, then the sigmoid for `output: sigmoid`. `running`: a request still
    generating (`LensRuntime.probe_progress`): only positions from `start` on, and a probe with nothing
    scored yet is left out instead of being an error. `cache`: shared by the requests of one fetch or
    progress RPC (each record read to the host once, whole: `Span.host_values`); by default one request's own.
    Numpy on the host copies, the positions once for the probes at a site: a probe costs a few array
    operations, not a device read each."""
    out = {}
    cache = {} if cache is None else cache
    sites: dict[tuple, _Rows | None] = {}  # this request's positions by its spans' rows
    for name, slot in got.items():
        rows: _Rows | None = None
        total: np.ndarray | None = None
        for site in slot.probe.sites:
            spans = slot.spans.get(site, [])
            key = tuple((id(sp.record), sp.r0, sp.r1) for sp in spans)
            r = sites[key] if key in sites else sites.setdefault(key, _rows(spans, cache, start, running))
            if r is None:
                if running:  # nothing scored yet: nothing new
                    rows = None
                    break
                raise RuntimeError(f"probe {name!r}: no rows were scored at {site} (site)")
            if rows is not None and r is not rows and not np.array_equal(r.pos, rows.pos):
                raise RuntimeError(f"probe {name!r}: its layers were scored at different positions")
            vals = [v for sp in spans[r.first :] if (v := sp.host_values(cache)) is not None]
            v = np.concatenate(vals) if len(vals) > 1 else vals[0]
            v = v[r.order] if r.order is not None else v
            if total is None:
                rows, total = r, (v if r.order is not None or len(vals) > 1 else v.copy())
            else:
                total += v
        if rows is None or total is None:
            continue
        total += slot.probe.bias.numpy()
        if slot.probe.sigmoid:
            total = torch.sigmoid(torch.from_numpy(total)).numpy()
        out[name] = probe_wire.pack(rows.wire, np.ascontiguousarray(total, dtype=np.float32).tobytes(), total.shape[1])
    return out
