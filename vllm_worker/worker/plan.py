"""Per-request state (decoded once) and the per-step plan (rebuilt before every forward pass).

Everything is keyed by tap site (`protocol.points`: a point of a layer), not by layer. The plan turns
"which requests sit in which rows of this batch" into what each tap site needs: device
row indices for capture, one batched add per layer for simple steering, and the (request, rows) lists for
the work that stays per request (positional / norm-matched steering, Python hooks). Rows of batch entry j
are `qsl[j]:qsl[j+1]`; built with numpy, no per-request Python work on the device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from vllm_worker.api.hooks import HookContext
from vllm_worker.protocol.points import CODE, IN, OUT, READ_ONLY, RESID_PRE, site
from vllm_worker.worker.actions import stage as stage_actions
from vllm_worker.worker.actions import staged_rows_of
from vllm_worker.worker.device_copy import to_device
from vllm_worker.worker.graph import GraphTaps
from vllm_worker.worker.probes import SiteProbes, stage_probes
from vllm_worker.worker.request_results import CaptureLog, RequestResults, StepArena
from vllm_worker.worker.saes import SiteFeatures, stage_features

PARTS_KEPT = 16  # entry parts remembered by entries object (`_entry_parts`)


@dataclass
class DeviceSteer:
    layers: dict[int, int]  # site -> row of vectors
    vectors: torch.Tensor  # on device, model dtype
    lut: torch.Tensor | None  # position -> row in vectors[:, row] (or -1); None for 2-D
    scale: float
    norm_match: bool
    positions: list[int] | None = None  # host copy of the positions `lut` maps (3-D vectors)
    mul: bool = False  # `vectors` multiply the activation (head scaling at z): Python path only
    gate: torch.Tensor | None = None  # (1,) device float its adds are multiplied by (`actions`: 0 until fired)
    op: int = 0  # `protocol.ops` code (`interventions` applies what is not a plain addition)
    lo: float | None = None  # cap's range
    hi: float | None = None
    span: tuple[int, int] | None = None  # absolute positions of its phase; None: all
    keep: torch.Tensor | None = None  # set: 1 where the activation is kept (heads not listed), 0 where written
    digest: bytes | None = None  # of `vectors` as sent (`graph_entries.item_key`: identical entries shared)

    @property
    def plain(self) -> bool:
        """A plain addition at every position of its rows (the graph path's single entries)."""
        return self.op == 0 and self.span is None and not self.mul


HookAt = tuple[int, bool]  # (site, late): late = a pre-hook of the next layer, run after that site's captures


def hook_at(layers: list[int], point: str, local_layers: frozenset) -> dict[HookAt, int]:
    """Where a hook on `point` of `layers` runs on this stage: a pre-hook of layer i at the site leaving
    layer i - 1 (after its captures), or — on the first layer of a stage — at the stage's input tap."""
    out: dict[HookAt, int] = {}
    for layer in layers:
        if point == RESID_PRE and layer - 1 in local_layers:
            out[(site(layer - 1, OUT), True)] = layer
        elif layer in local_layers:
            out[(site(layer, CODE[point] if point != RESID_PRE else IN), False)] = layer
    return out


@dataclass
class HookRun:
    fn: Callable
    at: dict[HookAt, int]  # where it runs -> the layer index it asked for (`ctx.layer_idx`)
    point: str
    ctx: HookContext
    index: int
    persistent: bool
    batched: bool = False  # one call per step and site for every request carrying the same hook (`key`)
    key: Any = None
    read_only: bool = False  # returns None (`Hook(read_only=True)`, or a read-only point): may run deferred

    def __post_init__(self) -> None:
        self.read_only = self.read_only or self.point in READ_ONLY


@dataclass(eq=False)
class RequestState:
    capture: list[int]  # sites captured (sorted)
    capture_slot: dict[int, int]  # site -> index in `capture`
    child: int
    steers: list[DeviceSteer]  # steering that needs per-request work (positions, norm_match)
    hooks: list[HookRun]
    store: RequestResults | None  # where results go (None: steering only)
    # site -> (1, d) sum of this request's position-independent, non-norm-matched vectors there;
    # such sites are steered for the whole batch with one index_add_ (`StepPlan.steer_batched`)
    simple_add: dict[int, torch.Tensor] = field(default_factory=dict)
    # graph-safe path (`graph`): site -> (default entry or -1, sorted positions, their entries, the entry of
    # generated positions, the first generated position or -1 without phases: `interventions.chain_entries`);
    # None when the request steers and its entries did not fit the table
    entries: "dict[int, tuple[int, np.ndarray, np.ndarray, int, int]] | None" = field(default_factory=dict)
    entry_ids: list[int] = field(default_factory=list)  # to give back when the request leaves
    sae: list = field(default_factory=list)  # `saes.SaeUse`s: features to return, clamps
    acts: list = field(default_factory=list)  # `actions.ActionUse`s: probe actions at this stage's sites
    probes: list = field(default_factory=list)  # `probes.DeviceProbe`s scored for this request
    graph_parts: Any = None  # (column map, entries, their split): `_entry_parts`, made once
    probe_sites: Any = None  # (probes, sites held here, the sites they read): `_probe_sites`, made once
    staged: Any = None  # (acts, last rows its actions stage a step; -1: all): `actions.staged_rows_of`, made once

    @property
    def failed(self) -> bool:
        return self.store is not None and self.store.error is not None

    @property
    def graph_ok(self) -> bool:
        """Everything this request asks for runs in the graph-safe kernel (no Python hooks, no SAE clamp)."""
        return not self.hooks and self.entries is not None and not any(u.clamp for u in self.sae)

    @property
    def seam_ok(self) -> bool:
        """All but its Python hooks runs in the graph-safe kernel, and the hooks can run after the kernel at
        their sites: the kernel steers and then captures in one go, so a hook the request runs at a site
        *before* its own capture there (or its SAE features) would be seen too late. Such requests take the
        Python path, where the order is steer, hooks, capture."""
        if self.entries is None or any(u.clamp for u in self.sae):
            return False
        early = {s for h in self.hooks for s, late in h.at if not late}
        probed = {s for u in self.probes for s in u.weights}
        return not (early & (set(self.capture) | probed)) and not any(u.site in early for u in self.sae)


Rows = list[tuple[RequestState, int, int]]  # (request, start row, end row)


@dataclass
class HookGroup:
    """A batched hook at one site: one call on the stacked rows of every request of the step carrying it."""

    layer: int  # the layer index it asked for (`ctx.layer_idx`)
    point: str
    members: list[tuple[RequestState, HookRun, int, int]]  # (request, its run, start row, end row)
    idx: torch.Tensor  # the members' rows on the device, in member order
    batch: Any = None  # `edits.Batch`: its context, rows and helpers, made on its first call


@dataclass
class GraphPlan:
    """What the graph-safe path writes into `graph.GraphTaps.ctl` each step, as flat host arrays."""

    n: int  # rows (tokens) of the step
    cap_rows: np.ndarray  # captured rows, in filing order (layer by layer, as `StepPlan.capture`)
    cap_cols: np.ndarray  # their site columns
    st_rows: np.ndarray  # rows with a position-independent steering entry ...
    st_cols: np.ndarray
    st_ents: np.ndarray  # ... and that entry
    # (start, end, col, positions, entries, default, generated entry, first generated position or -1)
    st_pos: list[tuple[int, int, int, np.ndarray, np.ndarray, int, int, int]]
    # rows whose entry depends on their phase only (prompt or generated): row, column, the prompt entry,
    # the generated one, the first generated position; chosen for all of them at once each step
    ph: tuple[np.ndarray, ...] = ()
    settled: bool = False  # every phase row was generated at the last fill: later steps' tables are the same
    n_extra: int = 0  # staged rows after the captures, read on the device only (SAE features)
    sae: dict = field(default_factory=dict)  # site -> (stage slots, batch rows, requests): `saes.stage_features`
    act: dict = field(default_factory=dict)  # site -> (stage slots, batch rows, requests): `actions.stage`
    probes: dict = field(default_factory=dict)  # sites -> `probes.StagedProbes` of them: `probes.stage_probes`

    @property
    def n_capture(self) -> int:
        """Staged rows that are captures (copied to the host)."""
        return len(self.cap_rows) - self.n_extra

    @property
    def total(self) -> int:
        return len(self.cap_rows)

    @functools.cached_property
    def live_cols(self) -> frozenset:
        """Site columns this step uses (calls from Python skip the others). Marked in a mask, not made into
        Python ints cell by cell: an all-layer plan's arrays hold a column per (row, site) cell."""
        parts = [self.cap_cols, self.st_cols, np.array([c for _, _, c, *_ in self.st_pos], dtype=np.int64)]
        if self.ph:
            parts.append(self.ph[1])
        cols = np.concatenate(parts).astype(np.int64, copy=False)
        if not len(cols):
            return frozenset()
        seen = np.zeros(int(cols.max()) + 1, dtype=bool)
        seen[cols] = True
        return frozenset(np.flatnonzero(seen).tolist())

    @property
    def steady(self) -> bool:
        """Every step of this plan has the same table (no entry depends on the position): once uploaded it
        serves the plan's next steps as it is (uploaded as their owner: `GraphTaps.reuse`). Rows choosing
        by phase count once all are generated (positions only grow within a plan)."""
        return not self.st_pos and (not self.ph or self.settled)

    def fill(self, ctl: np.ndarray, positions: np.ndarray) -> None:
        """Write this step into the host table (`ctl[col, row]`, the live columns' rows already -1; staging
        slots relative to the step's base); `positions`: host positions."""
        if len(self.cap_rows):
            ctl[self.cap_cols, self.cap_rows, 0] = np.arange(len(self.cap_rows), dtype=np.int32)
        if len(self.st_rows):
            ctl[self.st_cols, self.st_rows, 1] = self.st_ents
        for s, e, col, pos, ents, default, gen, split in self.st_pos:
            ps = positions[s:e]
            if len(pos):
                i = np.minimum(np.searchsorted(pos, ps), len(pos) - 1)
                got = np.where(pos[i] == ps, ents[i], default)
            else:
                got = np.full(len(ps), default, dtype=np.int32)
            ctl[col, s:e, 1] = got if split < 0 else np.where(ps >= split, gen, got)
        if self.ph:
            rows, cols, prompt, generated, first = self.ph
            later = positions[rows] >= first
            ctl[cols, rows, 1] = np.where(later, generated, prompt)
            self.settled = bool(later.all())


def rows_of(items: Rows) -> np.ndarray:
    """The batch rows of (request, start row, end row) items, in order (int64; vectorised: a plan of every
    layer of 256 requests is 8k items)."""
    if not items:
        return np.zeros(0, dtype=np.int64)
    se = np.array([(s, e) for _, s, e in items], dtype=np.int64).reshape(-1, 2)
    lens = se[:, 1] - se[:, 0]
    if bool((lens == 1).all()):  # decode: one row each
        return se[:, 0].copy()
    return np.repeat(se[:, 0] - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()), dtype=np.int64)


def graph_plan(
    active: Rows, cap_rows: dict[int, Rows], n: int, col: dict[int, int], memo: dict | None = None
) -> GraphPlan:
    """The graph path's plan of a batch; `memo`: requests' entry parts by entries object (`_entry_parts`)."""
    cr, cc = [], []
    for layer, items in cap_rows.items():
        rows = rows_of(items)
        cr.append(rows)
        cc.append(np.full(len(rows), col[layer]))
    pos: list = []
    ph: list[tuple[int, int, int, int, int, int]] = []  # (start, end, col, prompt entry, generated, split)
    spans, cols, ents = [], [], []  # requests with fixed entries: (start, rows, columns), their columns, entries
    for r, s, e in active:
        assert r.entries is not None, "a request whose entries did not fit the table is not graph-safe"
        fixed_cols, fixed_ents, by_pos, by_phase = _entry_parts(r, col, memo)
        if len(fixed_cols):
            spans.append((s, e - s, len(fixed_cols)))
            cols.append(fixed_cols)
            ents.append(fixed_ents)
        pos += [(s, e, c, ps, pe, default, gen, split) for c, ps, pe, default, gen, split in by_pos]
        ph += [(s, e, c, default, gen, split) for c, default, gen, split in by_phase]
    sr = sc = np.zeros(0, dtype=np.int64)
    se = np.zeros(0, dtype=np.int32)
    if spans:  # every (request, column) pair over the request's rows, in request then column order
        sp = np.array(spans, dtype=np.int64)
        lens = np.repeat(sp[:, 1], sp[:, 2])
        sr = np.repeat(np.repeat(sp[:, 0], sp[:, 2]) - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
        sc = np.repeat(np.concatenate(cols), lens)
        se = np.repeat(np.concatenate(ents), lens)

    def cat(a: list) -> np.ndarray:
        return np.concatenate(a).astype(np.int64) if a else np.zeros(0, dtype=np.int64)

    phase: tuple[np.ndarray, ...] = ()
    if ph:
        a = np.array(ph, dtype=np.int64)
        lens = a[:, 1] - a[:, 0]
        rows = np.repeat(a[:, 0] - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()), dtype=np.int64)
        ph_cols, prompt, generated, first = (np.repeat(a[:, k], lens) for k in (2, 3, 4, 5))
        phase = (rows, ph_cols, prompt.astype(np.int32), generated.astype(np.int32), first)
    return GraphPlan(n, cat(cr), cat(cc), sr, sc, se, pos, ph=phase)


def _probe_sites(r: RequestState, local: frozenset) -> tuple[int, ...]:
    """The sites held here that a request's probes read, each once. Made once per request (a plan is made at
    every change of the batch; W10's request has 8 probes)."""
    got = r.probe_sites
    if got is not None and got[0] is r.probes and got[1] is local:
        return got[2]
    sites = tuple(dict.fromkeys(s for u in r.probes for s in u.weights if s in local))
    r.probe_sites = (r.probes, local, sites)
    return sites


def _entry_parts(r: RequestState, col: dict[int, int], memo: dict | None = None) -> tuple:
    """A request's graph-path entries at this stage's columns, split by how a step picks them: fixed
    (columns, entries), by named position, by phase. Made once per request (a plan is made at every change
    of the batch, and a request ablating at 32 layers has 32 of them), and once per entries object: requests
    sharing one (equal steering: `admit_templates`, `interventions.chain_entries`) share its parts through
    `memo` (the graph taps' `parts_memo`: id -> (entries, col, parts), the entries held so the id stays
    theirs; bounded by `PARTS_KEPT`). Parts are read-only."""
    got = r.graph_parts
    ents = r.entries
    if got is not None and got[0] is col and got[1] is ents:
        return got[2]
    assert ents is not None
    hit = None if memo is None else memo.get(id(ents))
    if hit is not None and hit[0] is ents and hit[1] is col:
        r.graph_parts = (col, ents, hit[2])
        return hit[2]
    parts = _parts_of(ents, col)
    if memo is not None:  # (a request's own entries, e.g. gated ones, are never found: emptied when full)
        if len(memo) >= PARTS_KEPT:
            memo.clear()
        memo[id(ents)] = (ents, col, parts)
    r.graph_parts = (col, ents, parts)
    return parts


def _parts_of(entries: dict, col: dict[int, int]) -> tuple:
    cols, ents, by_pos, by_phase = [], [], [], []
    for layer, (default, ps, pe, gen, split) in entries.items():
        c = col.get(layer)
        if c is None:
            continue
        if len(ps):
            by_pos.append((c, ps, pe, default, gen, split))
        elif split >= 0:
            by_phase.append((c, default, gen, split))
        elif default >= 0:
            cols.append(c)
            ents.append(default)
    fixed = np.array(cols, dtype=np.int64), np.array(ents, dtype=np.int32)
    for a in fixed:
        a.flags.writeable = False
    return (*fixed, tuple(by_pos), tuple(by_phase))


@dataclass
class StepPlan:
    """Built once per batch composition (decode steps with the same requests reuse it); `begin_step`
    resets the per-step part."""

    positions: torch.Tensor | None  # device positions of the step (Python path; set by begin_step)
    steer: dict[int, Rows]  # site -> requests with per-request steering there
    steer_batched: dict[int, tuple[torch.Tensor, torch.Tensor]]  # site -> (rows, (rows, d) adds)
    capture: dict[int, tuple[torch.Tensor, Rows]]  # site -> (row index on device, requests)
    hooks: dict[HookAt, Rows]  # (site, late) -> requests with (per-request) hooks there
    captured: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    fired: int = 0  # tap calls seen during the forward (0 with work planned = taps were skipped)
    logs: dict[int, CaptureLog] = field(default_factory=dict)  # site -> its log (store.CaptureStore.open_plan)
    arena: StepArena | None = None  # host rows of this plan's steps
    graph: "GraphPlan | None" = None  # set: this composition runs on the graph-safe path
    requests: list = field(default_factory=list)  # the RequestStates it serves (failed together)
    sae_feat: dict = field(default_factory=dict)  # site -> (row index on device, saes.SiteFeatures)
    sae_clamp: dict = field(default_factory=dict)  # site -> requests clamping SAE features there
    probe_rows: dict = field(default_factory=dict)  # site -> (row index on device, SiteProbes): probe scores
    act_step: Any = None  # the probe actions' device indices for this composition (`action_step.current`)
    broken: bool = False  # our code failed during this step: the taps do nothing more
    fired_sites: set = field(default_factory=set)  # sites whose tap ran from Python this step
    groups: dict[HookAt, list[HookGroup]] = field(default_factory=dict)  # batched hooks
    deferred: list = field(default_factory=list)  # (site, stream snapshot) whose read-only hooks run after the forward
    hook_runs: dict = field(default_factory=dict)  # HookAt -> per-request hook calls there (`edits._per_request_runs`)
    row_cells: dict = field(default_factory=dict)  # batched hooks' `ctx.save_rows` values (`edits.Batch`)
    act_rows: dict = field(default_factory=dict)  # site -> (rows on device, host rows, requests): `actions`
    act_got: list = field(default_factory=list)  # the action rows read at the taps this step
    gather: frozenset = frozenset()  # mlp_post taps gathered across TP ranks this step (`tp_wide`)

    @functools.cached_property
    def seam_sites(self) -> frozenset:
        """Sites where this plan runs Python hooks. With `graph` set, the only Python of the step: the
        graph-safe kernel does the rest, and on GPU a full CUDA graph cut at these sites replays
        (`worker.seams`)."""
        return frozenset(s for s, _ in self.hooks) | frozenset(s for s, _ in self.groups)

    @functools.cached_property
    def defer_hooks(self) -> bool:
        """Every hook of this plan only reads: the taps snapshot the stream and the hooks run after the
        forward has been launched (`python_path.PythonPath.run_deferred`), so the device computes the rest of the
        step while their Python runs. One hook that may write keeps them all at their taps (a request's
        hooks share `ctx.saved`: their order must not change)."""
        runs = [h for items in self.hooks.values() for r, _, _ in items for h in r.hooks]
        runs += [h for gs in self.groups.values() for g in gs for _, h, _, _ in g.members]
        return bool(runs) and all(h.read_only for h in runs)

    def begin_step(self, positions: torch.Tensor) -> None:
        self.positions = positions
        self.captured = []
        self.fired = 0
        self.broken = False
        self.fired_sites = set()
        self.deferred = []
        self.act_got = []

    @functools.cached_property
    def sites(self) -> frozenset:
        """Every site this (Python-path) plan acts at."""
        return (
            frozenset(self.steer)
            | frozenset(self.steer_batched)
            | frozenset(self.capture)
            | {s for s, _ in self.hooks}
            | {s for s, _ in self.groups}
            | frozenset(self.sae_feat)
            | frozenset(self.sae_clamp)
            | frozenset(self.act_rows)
            | frozenset(self.probe_rows)
            | self.gather
        )


def split_steers(steers: list[DeviceSteer]) -> tuple[list[DeviceSteer], dict[int, torch.Tensor]]:
    """(steers needing per-request work, {layer: summed simple add}). A layer where any vector is
    positional or norm-matched keeps all its vectors per request (their order of application matters)."""
    complex_layers = {
        l
        for st in steers
        if st.lut is not None or st.norm_match or not st.plain or st.gate is not None
        for l in st.layers
    }
    per_request = [st for st in steers if set(st.layers) & complex_layers]
    mine = {id(st) for st in per_request}
    simple: dict[int, torch.Tensor] = {}
    for st in steers:
        if id(st) in mine:  # applied per request at every one of its layers (never twice)
            continue
        for layer, row in st.layers.items():
            add = st.vectors[row].unsqueeze(0) * st.scale
            simple[layer] = add if layer not in simple else simple[layer] + add
    return (per_request, {l: v.contiguous() for l, v in simple.items()})


def make_plan(
    active: Rows,
    device: torch.device,
    capturing_rank: bool,
    local: frozenset,
    graph: GraphTaps | None = None,
    n_rows: int = 0,
    seams: bool = False,
) -> StepPlan:
    """`local`: the sites this pipeline stage holds (captures of other stages' layers are theirs).
    `graph`: when every request fits the graph-safe path, the plan is for it; with `seams`, also when
    some only add Python hooks the kernel can run before (`RequestState.seam_ok`)."""
    steer: dict[int, Rows] = {}
    simple: dict[int, Rows] = {}
    cap_rows: dict[int, Rows] = {}
    hooks: dict[HookAt, Rows] = {}
    batched: dict[HookAt, dict[Any, list]] = {}
    sae_feat: dict[int, Rows] = {}
    sae_clamp: dict[int, Rows] = {}
    act: dict[int, Rows] = {}
    probe_rows: dict[int, Rows] = {}
    for item in active:
        r = item[0]
        if r.acts:
            for at in dict.fromkeys(s for u in r.acts for s in u.sites):
                act.setdefault(at, []).append(item)
        if capturing_rank and r.probes:  # scores: only the reporting rank
            for s in _probe_sites(r, local):
                probe_rows.setdefault(s, []).append(item)
        for u in r.sae:
            if u.site in local and (u.clamp or capturing_rank):  # features: only the reporting rank
                (sae_clamp if u.clamp else sae_feat).setdefault(u.site, []).append(item)
            if u.clamp and u.out_site is not None and u.out_site in local:  # a transcoder writes there
                sae_clamp.setdefault(u.out_site, []).append(item)
        for layer in r.simple_add:
            simple.setdefault(layer, []).append(item)
        for h in r.hooks:
            for at, layer in h.at.items():
                if h.batched:
                    batched.setdefault(at, {}).setdefault((h.key, layer), []).append((r, h, item[1], item[2]))
                else:
                    hooks.setdefault(at, []).append(item)
        if capturing_rank:
            for layer in r.capture:
                if layer in local:
                    cap_rows.setdefault(layer, []).append(item)

    def on_device(a: np.ndarray) -> torch.Tensor:
        return to_device(torch.from_numpy(a), device)

    # a request is listed once per layer even if several of its vectors/hooks act there
    hooks = {k: list(dict.fromkeys(v)) for k, v in hooks.items()}

    def hook_groups() -> dict[HookAt, list[HookGroup]]:
        return {
            at: [
                HookGroup(layer, members[0][1].point, members, on_device(group_rows(members)))
                for (_, layer), members in by_key.items()
            ]
            for at, by_key in batched.items()
        }

    if (
        graph is not None
        and graph.broken is None
        and n_rows <= graph.max_rows
        and all(r.graph_ok or (seams and r.seam_ok) for r, _, _ in active)
    ):
        gp = graph_plan(active, cap_rows, n_rows, graph.col, graph.parts_memo)
        stage_features(gp, cap_rows, {s: list(dict.fromkeys(v)) for s, v in sae_feat.items()}, graph.col)
        stage_probes(gp, probe_rows, graph.col, rows_of)
        stage_actions(gp, cap_rows, act, graph.col)  # last: it reuses any cell staged before it
        if gp.total <= graph.stage_rows:
            capture = {layer: (None, items) for layer, items in cap_rows.items()}
            # Python hooks, if any, run at their sites after the kernel (`runtime.LensRuntime._seam_tap`)
            return StepPlan(
                None,
                {},
                {},
                capture,
                hooks,
                graph=gp,
                requests=[r for r, _, _ in active],
                groups=hook_groups(),
            )

    for item in active:  # (per-request steering by layer: only this path reads it, W12's 32 a request)
        for st in item[0].steers:
            for layer in st.layers:
                steer.setdefault(layer, []).append(item)
    capture = {layer: (on_device(rows_of(items)), items) for layer, items in cap_rows.items()}
    steer_batched = {}
    for layer, items in simple.items():
        rows = rows_of(items)
        adds = torch.cat([r.simple_add[layer] for r, _, _ in items])  # (n_req, d) on device
        if len(rows) != len(items):  # prefill chunks: one add per row
            adds = adds.index_select(0, on_device(np.repeat(np.arange(len(items)), [e - s for _, s, e in items])))
        steer_batched[layer] = (on_device(rows), adds)
    steer = {l: list(dict.fromkeys(v)) for l, v in steer.items()}
    feat = {s: list(dict.fromkeys(v)) for s, v in sae_feat.items()}
    return StepPlan(
        None,
        steer,
        steer_batched,
        capture,
        hooks,
        requests=[r for r, _, _ in active],
        groups=hook_groups(),
        sae_feat={s: (on_device(rows_of(items)), SiteFeatures(s, items)) for s, items in feat.items()},
        sae_clamp={s: list(dict.fromkeys(v)) for s, v in sae_clamp.items()},
        act_rows={s: (on_device(rw), rw, items) for s, items in act.items() for rw in [staged_rows_of(items)]},
        probe_rows={s: (on_device(rows_of(items)), SiteProbes.of(s, items)) for s, items in probe_rows.items()},
    )


def group_rows(members: list) -> np.ndarray:
    """The batch rows of a batched hook's members, stacked in member order."""
    return np.concatenate([np.arange(s, e) for _, _, s, e in members])
