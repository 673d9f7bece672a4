"""What changes the stream at a tap: steering vectors and user hooks, on the rows of their own request.

`hidden` is edited in place (fused layers: the stream is `hidden + residual`, so an edit of the stream is
an edit of `hidden`). A hook failure fails its request only (`store.error`), never its batch-mates.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from typing import Callable

import numpy as np
import torch

from vllm_worker import counters
from vllm_worker.protocol.errors import failure
from vllm_worker.protocol.points import READ_ONLY
from vllm_worker.worker.device_copy import to_device
from vllm_worker.worker.interventions import steer_rows
from vllm_worker.worker.plan import HookAt, HookGroup, HookRun, Rows, StepPlan, group_rows
from vllm_worker.worker.request_results import RequestResults

logger = logging.getLogger("vllm_worker")


def steer(site: int, plan: StepPlan, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
    batched = plan.steer_batched.get(site)
    if batched is not None:
        hidden.index_add_(0, batched[0], batched[1].to(hidden.dtype))
    for r, s, e in plan.steer.get(site, ()):
        if not all(st.plain or st.mul and st.span is None for st in r.steers):  # ops / phases, in order
            steer_rows(r.steers, site, plan.positions, hidden, residual, s, e)
            continue
        stream_norm = None
        delta = None
        for st in r.steers:
            row = st.layers.get(site)
            if row is None:
                continue
            if st.mul:  # scaling (heads at z): what was added so far first, then the product
                if delta is not None:
                    hidden[s:e] += delta.to(hidden.dtype)
                    delta, stream_norm = None, None
                hidden[s:e] *= st.vectors[row].unsqueeze(0)
                continue
            if st.lut is None:
                v = st.vectors[row].unsqueeze(0)  # (1, d)
                mask = None
            else:
                assert plan.positions is not None  # set by begin_step on the Python path
                pos = plan.positions[s:e]
                n = st.lut.shape[0]
                vi = st.lut[pos.clamp(max=n - 1)]
                mask = ((pos < n) & (vi >= 0)).unsqueeze(1)
                v = st.vectors[row].index_select(0, vi.clamp(min=0))  # (rows, d)
            if st.norm_match:
                if stream_norm is None:
                    stream = hidden[s:e] if residual is None else hidden[s:e] + residual[s:e]
                    stream_norm = stream.norm(dim=-1, keepdim=True)
                v = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-12) * stream_norm
            add = v * st.scale
            if mask is not None:
                add = add * mask
            if st.gate is not None:  # a probe action's vector: 0 until it fired (no host read)
                add = add * st.gate
            delta = add if delta is None else delta + add
        if delta is not None:
            hidden[s:e] += delta.to(hidden.dtype)


def _where(h: HookRun, layer: int) -> str:
    kind = "persistent hook" if h.persistent else "hook"
    what = {"resid_pre": "pre-hook", "resid_post": "post-hook"}.get(h.point, f"{h.point} hook")
    return f"{kind} {h.index} ({what} at layer {layer})"


def _per_request_runs(plan: StepPlan, at: HookAt, items: Rows) -> tuple:
    """The per-request hook calls at `at`, flattened once per plan (decode steps with the same batch reuse
    it): `(runs, lo, hi)` with runs `(request, run, layer, start, end, first)` (`first`: the request's first
    hook here, which may read the tap's shared stream sum); `lo < hi` when the step's stream is summed once
    for rows `lo:hi` (every hooked row there, and not much else) instead of once per request."""
    cache = plan.hook_runs
    hit = cache.get(at)
    if hit is not None:
        return hit
    runs = []
    rows = 0
    for r, s, e in items:
        first = True
        for h in r.hooks:
            layer = h.at.get(at)
            if layer is None or h.batched:
                continue
            runs.append((r, h, layer, s, e, first))
            if first:
                rows += e - s
            first = False
    lo = min((s for _, _, _, s, _, _ in runs), default=0)
    hi = max((e for _, _, _, _, e, _ in runs), default=0)
    if len(runs) < 2 or hi - lo > 2 * rows:  # one request, or far apart: sum per request
        lo = hi = 0
    cache[at] = hit = (runs, lo, hi)
    return hit


def run_hooks(
    at: HookAt,
    plan: StepPlan,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    on_error: Callable[[HookRun, str], None],
) -> None:
    """Run each request's hooks on its own rows, then the batched hooks there (one call each for all their
    requests). `on_error(hook_run, message)` records a failure.

    Per call, only what differs between requests is done here: the plan's calls at `at` are flattened once
    per batch composition, and the stream `hidden + residual` of the hooked rows is summed once per tap,
    each request's first hook getting a view of its own rows (a fresh tensor no other request's hook sees).
    A request's later hooks at the same tap read the stream again (an earlier one may have changed it)."""
    items: Rows = plan.hooks.get(at, [])
    groups = plan.groups.get(at, ())
    if not items and not groups:
        return
    t_start = time.perf_counter()
    in_hooks = 0.0
    calls = 0
    if items:
        runs, lo, hi = _per_request_runs(plan, at, items)
        full = None
        if hi > lo:
            full = hidden[lo:hi] + residual[lo:hi] if residual is not None else hidden[lo:hi].clone()
        positions = plan.positions
        perf = time.perf_counter
        for r, h, layer, s, e, first in runs:
            if r.failed:  # (maybe by an earlier hook here)
                continue
            if first and full is not None:
                stream = full[s - lo : e - lo]
            else:
                stream = hidden[s:e] + residual[s:e] if residual is not None else hidden[s:e].clone()
            ctx = h.ctx
            ctx.layer_idx, ctx.point, ctx.seq_len, ctx._rows = layer, h.point, e - s, (positions, s, e)
            calls += 1
            t = perf()
            try:
                new = h.fn(ctx, stream)
            except Exception:
                in_hooks += perf() - t
                _hook_failed(r, h, layer, on_error)
                continue
            in_hooks += perf() - t
            if new is None:
                continue
            try:
                new = _check_replacement(new, stream, h.point, h.read_only)
            except Exception:
                _hook_failed(r, h, layer, on_error)
                continue
            assert new is not None
            # NaN / inf never enter the stream: on some backends (vLLM's CPU attention) they would reach
            # batch-mates. Checked on the device (no sync here); the request fails at fetch if it happened.
            finite = torch.isfinite(new).all()
            target = new - residual[s:e] if residual is not None else new
            hidden[s:e] = torch.where(finite, target, hidden[s:e])
            if r.store is not None:
                where = _where(h, layer)
                seen = r.store.nonfinite.get(where)
                r.store.nonfinite[where] = ~finite if seen is None else seen | ~finite
    for g in groups:
        calls += 1
        in_hooks += _run_group(g, plan, hidden, residual, on_error)
    counters.HOOK_TIMINGS["calls"] += calls
    counters.HOOK_TIMINGS["in_hooks_s"] += in_hooks
    counters.HOOK_TIMINGS["around_hooks_s"] += time.perf_counter() - t_start - in_hooks


def _hook_failed(r, h: HookRun, layer: int, on_error: Callable[[HookRun, str], None]) -> None:
    """The hook raised or returned something invalid (the exception being handled): its request fails."""
    _FAILURES[0] += 1
    where = _where(h, layer)
    msg = f"{where} failed:\n" + traceback.format_exc()
    if r.store is None:
        r.store = RequestResults([])
    r.store.fail(failure("hook", msg, where.split("(", 1)[1].rstrip(")")))
    on_error(h, msg)
    logger.warning("inspect-lens: %s", msg)


def _check_replacement(new: object, stream: torch.Tensor, point: str, read_only: bool = False) -> torch.Tensor | None:
    if new is None:
        return None
    if point in READ_ONLY:
        raise TypeError(f"hooks at {point!r} read it; they cannot replace it (return None)")
    if read_only:
        raise TypeError("a read_only hook returned a tensor; it may only read (return None)")
    if not isinstance(new, torch.Tensor):
        raise TypeError(f"hook returned {type(new).__name__}, expected a Tensor or None")
    if new.shape != stream.shape or new.dtype != stream.dtype or new.device != stream.device:
        raise TypeError(
            f"hook returned shape {tuple(new.shape)} {new.dtype} on {new.device}; expected "
            f"{tuple(stream.shape)} {stream.dtype} on {stream.device} (the rows it was given)"
        )
    return new


class _Cell:
    """The values a batched hook last gave `ctx.save_rows` under one name, for one set of requests."""

    __slots__ = ("values", "_cpu")

    def __init__(self) -> None:
        self.values: torch.Tensor | None = None
        self._cpu: tuple | None = None  # (values, their host copy): one copy for every request's row

    def cpu(self) -> torch.Tensor:
        values = self.values
        assert values is not None
        if self._cpu is None or self._cpu[0] is not values:
            self._cpu = (values, values.detach().to("cpu"))
        return self._cpu[1]


class SavedRow:
    """What `ctx.save_rows(name, values)` leaves in one request's saved dict: row `i` of the values last
    saved under `name` for that request's batch. Split off when the results leave the worker
    (`saved_state.to_cpu`: a tensor of its own); `.value` reads it inside a hook."""

    __slots__ = ("cell", "i")

    def __init__(self, cell: _Cell, i: int) -> None:
        self.cell, self.i = cell, i

    @property
    def value(self) -> torch.Tensor:
        assert self.cell.values is not None
        return self.cell.values[self.i]

    def to_cpu(self) -> torch.Tensor:
        return self.cell.cpu()[self.i].clone()

    def __repr__(self) -> str:
        return f"SavedRow({self.i})"


class BatchSaved(dict):
    """`ctx.saved` of a batched hook: request id -> that request's saved dict. Any other key would be lost
    without a word (the per-request habit `ctx.saved["mean"] = ...`): writing one is an error that says
    where the value belongs."""

    def _refuse(self, key: object) -> None:
        if key not in self:
            raise KeyError(
                f"ctx.saved[{key!r}] = ...: a batched hook's ctx.saved holds one dict per request (keys: the "
                "request ids of ctx.rows). Save per request with ctx.saved[request_id][name] = value, or one "
                "row per request with ctx.save_rows(name, values)"
            )

    def __setitem__(self, key: object, value: object) -> None:
        self._refuse(key)
        super().__setitem__(key, value)

    def setdefault(self, key: object, default: object = None) -> object:
        self._refuse(key)
        return super().setdefault(key, default)

    def update(self, *args: object, **kwargs: object) -> None:
        for key in dict(*args, **kwargs):
            self._refuse(key)
        super().update(*args, **kwargs)


_FAILURES = [0]  # hook failures so far: a batched hook's cached members are checked again when it moves


class Batch:
    """A batched hook's requests for one batch composition (cached on its `HookGroup`, so decode steps with
    the same batch reuse it): `ctx.rows`, `ctx.saved`, the context, and the helpers of `HookContext`
    (`segment_ids`, `counts`: made on first use from host numbers, one non-blocking copy, no device sync;
    `save_rows`)."""

    def __init__(self, members: list, idx: torch.Tensor, cells: dict) -> None:
        self.members, self.idx, self.epoch = members, idx, _FAILURES[0]
        self.sizes = np.array([e - s for _, _, s, e in members], dtype=np.int64)
        ends = np.cumsum(self.sizes)
        self.rows = [(h.ctx.request_id, int(b - n), int(b)) for (_, h, _, _), n, b in zip(members, self.sizes, ends)]
        dicts = [h.ctx.saved for _, h, _, _ in members]
        self._dicts = dicts
        self._key = tuple(map(id, dicts))  # the same requests' dicts: the same cells (every layer of the hook)
        self._cells = cells
        self._dev: dict[str, torch.Tensor] = {}
        self.ctx = (
            dataclasses.replace(
                members[0][1].ctx,
                saved=BatchSaved({h.ctx.request_id: h.ctx.saved for _, h, _, _ in members}),
                seq_len=int(ends[-1]),
                request_id="",
                rows=self.rows,
                _batch=self,
            )
            if members
            else None
        )

    def _upload(self, name: str, host: np.ndarray) -> torch.Tensor:
        t = self._dev.get(name)
        if t is None:
            t = self._dev[name] = to_device(torch.from_numpy(host), self.idx.device)
        return t

    @property
    def counts(self) -> torch.Tensor:
        return self._upload("counts", self.sizes)

    @property
    def segment_ids(self) -> torch.Tensor:
        return self._upload("segment_ids", np.repeat(np.arange(len(self.sizes), dtype=np.int64), self.sizes))

    def save_rows(self, name: object, values: torch.Tensor) -> None:
        if not isinstance(values, torch.Tensor) or values.dim() == 0 or values.shape[0] != len(self.rows):
            got = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(
                f"save_rows({name!r}, values): values needs one row per request ({len(self.rows)}), got {got}"
            )
        cell = self._cells.get((self._key, name))
        if cell is None:  # first save under `name` for these requests in this batch: point their dicts here
            cell = self._cells[(self._key, name)] = _Cell()
            for i, d in enumerate(self._dicts):
                d[name] = SavedRow(cell, i)
        cell.values = values


def _batch(g: HookGroup, plan: StepPlan) -> Batch:
    """`g`'s `Batch` for this step: the cached one unless one of its requests failed since."""
    b: Batch | None = g.batch
    if b is not None and b.epoch == _FAILURES[0]:
        return b
    members = [m for m in g.members if not m[0].failed]
    if b is not None and len(members) == len(b.members):
        b.epoch = _FAILURES[0]
        return b
    idx = g.idx if len(members) == len(g.members) else to_device(torch.from_numpy(group_rows(members)), g.idx.device)
    b = g.batch = Batch(members, idx, plan.row_cells)
    return b


def _run_group(
    g: HookGroup, plan: StepPlan, hidden: torch.Tensor, residual: torch.Tensor | None, on_error: Callable
) -> float:
    """One call of a batched hook on its requests' rows (gathered with one index, written back with one);
    no per-request Python in the steady state (`Batch` is made once per batch composition). Returns the
    seconds spent inside the hook."""
    b = _batch(g, plan)
    members, idx, ctx = b.members, b.idx, b.ctx
    if ctx is None:
        return 0.0
    before = hidden.index_select(0, idx)
    stream = before + residual.index_select(0, idx) if residual is not None else before.clone()
    ctx.layer_idx, ctx.point, ctx._rows = g.layer, g.point, (plan.positions, idx)
    t = time.perf_counter()
    try:
        try:
            new = members[0][1].fn(ctx, stream)
        finally:
            spent = time.perf_counter() - t
        new = _check_replacement(new, stream, g.point, members[0][1].read_only)
    except Exception:
        for r, h, _, _ in members:  # one call for all of them: each of its requests fails
            _hook_failed(r, h, g.layer, on_error)
        return spent
    if new is None:
        return spent
    # per row: a row whose new value is not finite keeps its old one, and its request fails at fetch
    finite = torch.isfinite(new).all(dim=-1)
    target = new - residual.index_select(0, idx) if residual is not None else new
    hidden.index_copy_(0, idx, torch.where(finite.unsqueeze(1), target, before))
    for (r, h, _, _), (_, s, e) in zip(members, b.rows):
        if r.store is not None:
            where = _where(h, g.layer)
            bad = ~finite[s:e].all()
            seen = r.store.nonfinite.get(where)
            r.store.nonfinite[where] = bad if seen is None else seen | bad
    return spent
