"""SAEs in a worker: loaded on the device (`lens_load_sae`), turned into per-request uses at admission,
and run each step on the rows of the requests that use them.

- Features (`output_sae_features`): encoded from rows the capture machinery already gathers at the SAE's
  site. Graph-safe path: the kernel stages those rows in the device ring with the step's captures (after
  them: `stage_features`), and after the step they are encoded there, on the device, before anything is
  copied to the host (`features_from_stage`) — the step keeps its CUDA graphs. Python path: encoded from
  the rows at the tap (`features_at`). Results stay on the device (a few bytes a token) until fetched.
- Clamping (`apply_sae_clamp`): encode, set, decode the difference, added to the stream at the tap
  (`clamp_at`): Python path only (it needs the encode inside the forward pass).
- Steering with features never reaches here: the frontend made it an ordinary steering vector.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_worker.counters import SAE_COUNTS
from vllm_worker.protocol.wire import tensor_to_bytes
from vllm_worker.sae import Sae, load
from vllm_worker.worker.device_copy import to_device
from vllm_worker.worker.step_records import Span, StepRecord, latest
from vllm_worker.worker.stream_rows import stream_rows


@dataclass(eq=False)
class SaeUse:
    name: str
    sae: Sae  # on this worker's device
    site: int
    top_k: int = 0  # > 0: the k strongest features per position
    ids: torch.Tensor | None = None  # chosen features (returned, or clamped) on the device
    values: torch.Tensor | None = None  # clamp values (float32, on the device)
    clamp: bool = False
    out_site: int | None = None  # a transcoder's clamp: the delta is computed at `site`, added here
    pending: torch.Tensor | None = None  # that delta, between the two taps of one forward pass
    id_list: tuple[int, ...] = ()  # `ids` on the host (features: a composition's union is made there)


class WorkerSaes:
    """This worker's SAEs by name: (uid, weights on the device, or None when another pipeline stage holds
    the SAE's layer)."""

    def __init__(self, device: torch.device, local_layers: frozenset) -> None:
        self.device, self.local_layers = device, local_layers
        self.loaded: dict[str, tuple[str, Sae | None]] = {}

    def load(self, name: str, path: str, uid: str) -> dict[str, Any]:
        sae = load(path)
        local = sae.layer in self.local_layers
        self.loaded[name] = (uid, sae.to(self.device) if local else None)
        return {"name": name, "layer": sae.layer, "local": local}

    def uses(self, entries: list[dict[str, Any]]) -> list[SaeUse]:
        """A request's `RequestSpec.sae` entries as device-side uses (those of this stage's layers)."""
        out = []
        for u in entries:
            got = self.loaded.get(u["sae"])
            if got is None:
                raise ValueError(f"SAE {u['sae']!r} is not loaded in this worker")
            if got[0] != u["uid"]:
                raise ValueError(f"SAE {u['sae']!r} was replaced while this request was on its way; send it again")
            sae = got[1]
            if sae is None:
                continue
            ids = None if u.get("ids") is None else to_device(torch.tensor(u["ids"], dtype=torch.long), self.device)
            values = None
            if u.get("clamp"):
                values = to_device(torch.tensor(u["values"], dtype=torch.float32), self.device)
            out_site = None if u.get("out_site") is None else int(u["out_site"])
            top_k = int(u.get("top_k") or 0)
            use = SaeUse(u["sae"], sae, int(u["site"]), top_k, ids, values, bool(u.get("clamp")), out_site)
            use.id_list = () if u.get("ids") is None else tuple(int(i) for i in u["ids"])
            out.append(use)
        return out


# ---------------------------------------------------------------- per step


def clamp_at(site: int, plan: Any, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
    """Python path, at a tap: each clamping request's rows get decode(f with f[ids] = values) - decode(f).
    A transcoder's delta is computed where it reads and added where it writes (a later tap of the same
    forward pass)."""
    for r, s, e in plan.sae_clamp.get(site, ()):
        for u in r.sae:
            if not u.clamp:
                continue
            if u.out_site is not None and site == u.out_site:
                delta, u.pending = u.pending, None
                if delta is None or delta.shape[0] != e - s:
                    raise RuntimeError(f"transcoder {u.name!r}: no clamp delta from its input point this step")
                hidden[s:e] += delta.to(hidden.dtype)
            elif u.site == site:
                x = hidden[s:e] if residual is None else hidden[s:e] + residual[s:e]
                delta = u.sae.clamp_delta(x, u.ids, u.values)
                SAE_COUNTS["clamp_rows"] += e - s
                if u.out_site is None:
                    hidden[s:e] += delta.to(hidden.dtype)
                else:
                    u.pending = delta


def features_at(site: int, plan: Any, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
    """Python path, at a tap (after the site's edits, as captures): features of the rows there."""
    got = plan.sae_feat.get(site)
    if got is None:
        return
    idx, sf = got
    sf.file(stream_rows(hidden, residual, idx), plan.positions.index_select(0, idx))


def features_from_stage(gp: Any, stage: torch.Tensor, base: int, positions: np.ndarray) -> None:
    """Graph-safe path, after the step: features of the rows the kernel staged for them (on the device,
    before the ring is reused: later steps' kernels come after these on the same stream)."""
    for slots, rows, sf in gp.sae.values():
        if sf.slots is None:  # once per composition: a step only moves the ring's base
            sf.slots = to_device(torch.from_numpy(slots), stage.device)
        sf.file(stage.narrow(0, base, gp.total).index_select(0, sf.slots), positions[rows])


class SiteFeatures:
    """The requests whose features are encoded at one site in a batch composition. At its first step it
    makes the record the features go to (`step_records`) and each request's spans of it; a step is then one
    encode per SAE, one top-k per (SAE, k) and one column pick per SAE (the union of the requests' chosen
    features), whatever the number of requests."""

    def __init__(self, site: int, items: list) -> None:
        self.site, self.items = site, items
        self.record: StepRecord | None = None
        self.slots: torch.Tensor | None = None  # graph-safe path: the rows' stage slots, on the device
        self.saes: dict[str, Sae] = {}  # name -> the SAE its uses here share
        self.top: dict[str, list[int]] = {}  # name -> its top-k sizes
        self.ids: dict[str, np.ndarray] = {}  # name -> the union of the chosen features, sorted
        self.ids_dev: dict[str, torch.Tensor] = {}  # ... on the device

    def file(self, x: torch.Tensor, pos: np.ndarray | torch.Tensor) -> None:
        """Encode rows `x` (the rows of `items`, in order) once per SAE into this step's row of the record."""
        first = self.record is None
        if first:
            self._plan()
        encoded = {}
        for name, sae in self.saes.items():
            encoded[name] = sae.encode(x)[0]
            SAE_COUNTS["feature_rows"] += x.shape[0]
        rec = self.record
        if rec is None:
            rec = self.record = self._open(x.device, {n: f.dtype for n, f in encoded.items()})
        out = rec.next(pos)
        for name, f in encoded.items():
            for k in self.top.get(name, ()):
                torch.topk(f, k, dim=-1, out=(out[("top", name, k)], out[("topi", name, k)]))
            ids = self.ids_dev.get(name)
            if ids is not None:
                torch.index_select(f, 1, ids, out=out[("ids", name)])

    def _uses(self) -> list[tuple[Any, int, int, SaeUse]]:
        """(request, first row, end row, use) of every feature use here, in staging order."""
        out, off = [], 0
        for r, s, e in self.items:
            for u in r.sae:
                if not u.clamp and u.site == self.site:
                    out.append((r, off, off + e - s, u))
            off += e - s
        return out

    def _plan(self) -> None:
        """Which SAEs to encode, which top-k sizes and features to keep (once per composition)."""
        chosen: dict[str, set[int]] = {}
        for _, _, _, u in self._uses():
            self.saes.setdefault(u.name, u.sae)
            if u.top_k:
                if u.top_k not in self.top.setdefault(u.name, []):
                    self.top[u.name].append(u.top_k)
            elif u.ids is not None:
                chosen.setdefault(u.name, set()).update(u.id_list)
        self.ids = {name: np.array(sorted(got), dtype=np.int64) for name, got in chosen.items()}

    def _open(self, device: torch.device, dtypes: dict[str, torch.dtype]) -> StepRecord:
        """The composition's record, and each request's spans of it."""
        blocks: dict[Any, tuple[int, torch.dtype]] = {}
        for name, ks in self.top.items():
            for k in ks:
                blocks[("top", name, k)] = (k, dtypes[name])
                blocks[("topi", name, k)] = (k, torch.int64)
        for name, ids in self.ids.items():
            blocks[("ids", name)] = (len(ids), dtypes[name])
        self.ids_dev = {name: to_device(torch.from_numpy(ids), device) for name, ids in self.ids.items()}
        rows = sum(e - s for _, s, e in self.items)
        rec = StepRecord(rows, blocks, device)
        for r, r0, r1, u in self._uses():
            if r.store is None:
                continue
            if u.top_k:
                span = Span(rec, r0, r1, ("top", u.name, u.top_k), slice(None))
            else:
                cols = torch.from_numpy(np.searchsorted(self.ids[u.name], np.array(u.id_list, dtype=np.int64)))
                span = Span(rec, r0, r1, ("ids", u.name), cols)
            r.store.sae.setdefault(u.name, {"ids": u.ids, "spans": []})["spans"].append(span)
        return rec


def stage_features(gp: Any, cap_rows: dict, sae_feat: dict, col: dict[int, int]) -> None:
    """Graph-safe plan: rows to encode are staged by the kernel like captures. A request that also captures
    the site reads its capture slots; the others get slots after the step's captures (`gp.n_extra`, never
    copied to the host)."""
    if not sae_feat:
        return
    where: dict[tuple[int, int], int] = {}
    off = 0
    for site, items in cap_rows.items():  # the capture part's layout (`plan.graph_plan`)
        for r, s, e in items:
            where[(id(r), site)] = off
            off += e - s
    n_cap = off
    extra_rows, extra_cols = [gp.cap_rows], [gp.cap_cols]
    for site, items in sae_feat.items():
        slots, rows = [], []
        for r, s, e in items:
            o = where.get((id(r), site))
            if o is None:
                o, off = off, off + e - s
                extra_rows.append(np.arange(s, e))
                extra_cols.append(np.full(e - s, col[site]))
            slots.append(np.arange(o, o + e - s))
            rows.append(np.arange(s, e))
        gp.sae[site] = (np.concatenate(slots), np.concatenate(rows), SiteFeatures(site, items))
    gp.cap_rows = np.concatenate(extra_rows).astype(np.int64)
    gp.cap_cols = np.concatenate(extra_cols).astype(np.int64)
    gp.n_extra = off - n_cap


# ---------------------------------------------------------------- fetch


def payload(got: dict[str, dict], cache: dict | None = None) -> dict[str, dict]:
    """A request's features as bytes, per SAE: positions sorted (a position run twice keeps its last run).
    `cache`: shared by the requests of one fetch (`step_records.Span.pieces`); by default this request's own."""
    out = {}
    cache = {} if cache is None else cache
    for name, slot in got.items():
        spans = slot["spans"]
        if slot["ids"] is None:  # top_k: ids per position, beside their values
            pieces = [
                (p, v, i)
                for sp in spans
                for (p, v), (_, i) in zip(sp.pieces(cache=cache), sp.pieces(("topi", *sp.key[1:]), cache))
            ]
            pos, vals, ind = latest(pieces)
            item = {"indices": tensor_to_bytes(ind.contiguous())}
        else:
            pos, vals = latest([pc for sp in spans for pc in sp.pieces(cache=cache)])
            item = {"indices": tensor_to_bytes(slot["ids"].cpu())}
        out[name] = {"positions": tensor_to_bytes(pos), "values": tensor_to_bytes(vals.contiguous()), **item}
    return out
