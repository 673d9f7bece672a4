"""Probes in a worker: loaded on the device (`lens_load_probe`), turned into per-request uses at admission,
and scored each step on the rows of the requests that name them, as SAE features are (`worker/saes`).

- Graph-safe path: the kernel stages the rows at each probe's site with the step's captures (a request
  capturing the site lends its capture slots; the others get slots after every other staged row:
  `stage_probes`); after the step they are projected there, on the device (`scores_from_stage`).
- Python path: projected from the rows at the tap (`scores_at`).

Either way one matmul per site serves every request and probe of the step: the weights of the probes used
at a site are stacked once per batch composition (`SiteProbes`). A multi-layer probe is a sum of one
projection per layer (mean / std folded into the weights: `Probe.folded`); the per-site parts are added,
the bias added and the sigmoid applied when the request's scores are fetched (`payload`). Scores wait on
the device (n_out floats a token) until then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_worker.probes.format import Probe, check_probe
from vllm_worker.protocol.points import canonical_site
from vllm_worker.protocol.wire import tensor_from_bytes, tensor_to_bytes
from vllm_worker.worker.stream_rows import stream_rows

PROBE_COUNTS = {"rows": 0, "projections": 0}  # rows this process scored, matmuls it ran (tests, benchmarks)


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
        self.loaded[name] = DeviceProbe(name, uid, weights, bias, p.output == "sigmoid", sites)
        return {"name": name, "local_layers": local}

    def delete(self, name: str) -> bool:
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


@dataclass
class SiteProbes:
    """The requests scored at one site in a batch composition, and the stacked weights of their probes."""

    items: list  # (request, start row, end row), in staging order
    weight: torch.Tensor  # (sum of n_out, d) on the device
    cols: dict[tuple[str, str], tuple[int, int]]  # (name, uid) -> its columns of the projection

    @classmethod
    def of(cls, site: int, items: list) -> "SiteProbes":
        used: dict[tuple[str, str], torch.Tensor] = {}
        for r, _, _ in items:
            for u in r.probes:
                if site in u.weights:
                    used.setdefault((u.name, u.uid), u.weights[site])
        cols, c = {}, 0
        for key, w in used.items():
            cols[key] = (c, c + w.shape[0])
            c += w.shape[0]
        return cls(items, torch.cat(list(used.values())), cols)


@dataclass
class ProbeScores:
    """A request's scores of one probe on this worker: per site, (positions, partial scores) per step."""

    probe: DeviceProbe
    chunks: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


# ---------------------------------------------------------------- per step


def file_scores(site: int, x: torch.Tensor, pos: torch.Tensor, sp: SiteProbes) -> None:
    """Project rows `x` (the rows of `sp.items`, in order) on every probe of the site at once and file each
    request's columns."""
    y = x.to(torch.float32) @ sp.weight.T
    PROBE_COUNTS["rows"] += x.shape[0]
    PROBE_COUNTS["projections"] += 1
    off = 0
    for r, s, e in sp.items:
        n = e - s
        for u in r.probes:
            if site in u.weights and r.store is not None:
                c0, c1 = sp.cols[(u.name, u.uid)]
                slot = r.store.probes.get(u.name)
                if slot is None:
                    slot = r.store.probes[u.name] = ProbeScores(u)
                slot.chunks.setdefault(site, []).append((pos[off : off + n], y[off : off + n, c0:c1]))
        off += n


def scores_at(site: int, plan: Any, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
    """Python path, at a tap (after the site's edits, as captures): scores of the rows there."""
    got = plan.probe_rows.get(site)
    if got is None:
        return
    idx, sp = got
    x = stream_rows(hidden, residual, idx)
    file_scores(site, x, plan.positions.index_select(0, idx), sp)


def scores_from_stage(gp: Any, stage: torch.Tensor, base: int, positions: np.ndarray) -> None:
    """Graph-safe path, after the step: scores of the rows the kernel staged for them (on the device,
    before the ring is reused: later steps' kernels come after these on the same stream)."""
    for site, (slots, rows, sp) in gp.probes.items():
        idx = torch.from_numpy(base + slots).to(stage.device, non_blocking=True)
        file_scores(site, stage.index_select(0, idx), torch.from_numpy(positions[rows]), sp)


def stage_probes(gp: Any, probe_rows: dict, col: dict[int, int], rows_of: Any) -> None:
    """Graph-safe plan: the rows each probe site reads, staged by the kernel. A row already staged at that
    site (a capture, an SAE's) lends its slot — a row has one slot per site in the table; the others get
    slots after everything staged so far (`gp.n_extra`: never copied to the host)."""
    if not probe_rows:
        return
    width = gp.n + 1
    keys = gp.cap_cols.astype(np.int64) * width + gp.cap_rows
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    total = len(keys)
    extra_rows, extra_cols = [gp.cap_rows], [gp.cap_cols]
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
        gp.probes[site] = (slots, rows, SiteProbes.of(site, items))
    added = total - len(keys)
    gp.cap_rows = np.concatenate(extra_rows).astype(np.int64)
    gp.cap_cols = np.concatenate(extra_cols).astype(np.int64)
    gp.n_extra += added


# ---------------------------------------------------------------- fetch


def _latest(chunks: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions sorted, a position run twice (a preempted request's recompute) keeping its last run."""
    pos = torch.cat([c[0].to("cpu", torch.int64) for c in chunks])
    vals = torch.cat([c[1] for c in chunks]).to("cpu")
    order = torch.sort(pos, stable=True).indices
    pos, vals = pos[order], vals[order]
    keep = torch.ones(len(pos), dtype=torch.bool)
    keep[:-1] = pos[1:] != pos[:-1]
    return pos[keep], vals[keep]


def _since(chunks: list[tuple[torch.Tensor, torch.Tensor]], start: int) -> list:
    """The latest chunks, back to the first one reaching below position `start` (chunks come in step order)."""
    if start <= 0:
        return chunks
    i = len(chunks)
    while i > 0:
        i -= 1
        p = chunks[i][0]
        if len(p) and int(p.min()) < start:
            break
    return chunks[i:]


def payload(got: dict[str, ProbeScores], start: int = 0, running: bool = False) -> dict[str, dict[str, Any]]:
    """A request's scores as bytes, per probe: {"positions": (n,) int64, "scores": (n, n_out) float32} —
    the layers' parts added, then the bias, then the sigmoid for `output: sigmoid`. `running`: a request still
    generating (`LensRuntime.probe_progress`): only positions from `start` on, and a probe with nothing
    scored yet is left out instead of being an error."""
    out = {}
    for name, slot in got.items():
        pos, total = None, None
        for site in slot.probe.sites:
            chunks = _since(slot.chunks.get(site) or [], start)
            if not chunks:
                if running:  # nothing scored yet: nothing new
                    break
                raise RuntimeError(f"probe {name!r}: no rows were scored at {site} (site)")
            p, v = _latest(chunks)
            if running:
                keep = p >= start
                p, v = p[keep], v[keep]
            if pos is None:
                pos, total = p, v.clone()
            elif not torch.equal(p, pos):
                raise RuntimeError(f"probe {name!r}: its layers were scored at different positions")
            else:
                total += v
        if pos is None or total is None:
            continue
        total += slot.probe.bias
        if slot.probe.sigmoid:
            total = torch.sigmoid(total)
        out[name] = {"positions": tensor_to_bytes(pos), "scores": tensor_to_bytes(total.contiguous())}
    return out
