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

import torch

from vllm_worker.protocol.errors import failure
from vllm_worker.protocol.points import READ_ONLY
from vllm_worker.worker.plan import HookAt, HookGroup, HookRun, Rows, StepPlan, group_rows
from vllm_worker.worker.results import RequestResults

logger = logging.getLogger("vllm_worker")

# Diagnostics (in `status`, read by benchmarks): where the time of Python hooks goes, cumulative host
# seconds — inside the users' functions, and around them (slicing, the stream sum, checks).
HOOK_TIMINGS = {"calls": 0, "in_hooks_s": 0.0, "around_hooks_s": 0.0}


def steer(site: int, plan: StepPlan, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
    batched = plan.steer_batched.get(site)
    if batched is not None:
        hidden.index_add_(0, batched[0], batched[1].to(hidden.dtype))
    for r, s, e in plan.steer.get(site, ()):
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
            delta = add if delta is None else delta + add
        if delta is not None:
            hidden[s:e] += delta.to(hidden.dtype)


def _where(h: HookRun, layer: int) -> str:
    kind = "persistent hook" if h.persistent else "hook"
    what = {"resid_pre": "pre-hook", "resid_post": "post-hook"}.get(h.point, f"{h.point} hook")
    return f"{kind} {h.index} ({what} at layer {layer})"


def run_hooks(
    at: HookAt,
    plan: StepPlan,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    on_error: Callable[[HookRun, str], None],
) -> None:
    """Run each request's hooks on its own rows, then the batched hooks there (one call each for all their
    requests). `on_error(hook_run, message)` records a failure."""
    items: Rows = plan.hooks.get(at, [])
    groups = plan.groups.get(at, ())
    if not items and not groups:
        return
    t_start = time.perf_counter()
    in_hooks = 0.0
    calls = 0
    for r, s, e in items:
        for h in r.hooks:
            layer = h.at.get(at)
            if layer is None or r.failed or h.batched:
                continue
            stream = hidden[s:e] + residual[s:e] if residual is not None else hidden[s:e].clone()
            ctx = h.ctx
            ctx.layer_idx, ctx.point, ctx.seq_len, ctx._rows = layer, h.point, e - s, (plan.positions, s, e)
            try:
                calls += 1
                t = time.perf_counter()
                try:
                    new = h.fn(ctx, stream)
                finally:
                    in_hooks += time.perf_counter() - t
                new = _check_replacement(new, stream, h.point, h.read_only)
                if new is None:
                    continue
            except Exception:
                _hook_failed(r, h, layer, on_error)
                break
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
    HOOK_TIMINGS["calls"] += calls
    HOOK_TIMINGS["in_hooks_s"] += in_hooks
    HOOK_TIMINGS["around_hooks_s"] += time.perf_counter() - t_start - in_hooks


def _hook_failed(r, h: HookRun, layer: int, on_error: Callable[[HookRun, str], None]) -> None:
    """The hook raised or returned something invalid (the exception being handled): its request fails."""
    where = _where(h, layer)
    msg = f"{where} failed:\n" + traceback.format_exc()
    if r.store is None:
        r.store = RequestResults([])
    r.store.error = failure("hook", msg, where.split("(", 1)[1].rstrip(")"))
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


def _run_group(
    g: HookGroup, plan: StepPlan, hidden: torch.Tensor, residual: torch.Tensor | None, on_error: Callable
) -> float:
    """One call of a batched hook on its requests' rows (gathered with one index, written back with one);
    no per-request Python beyond building `ctx.rows`. Returns the seconds spent inside the hook."""
    members = [m for m in g.members if not m[0].failed]
    if not members:
        return 0.0
    idx = g.idx if len(members) == len(g.members) else torch.from_numpy(group_rows(members)).to(hidden.device)
    before = hidden.index_select(0, idx)
    stream = before + residual.index_select(0, idx) if residual is not None else before.clone()
    rows, off = [], 0
    for _, h, s, e in members:
        rows.append((h.ctx.request_id, off, off + e - s))
        off += e - s
    first = members[0][1].ctx
    ctx = dataclasses.replace(
        first,
        saved={h.ctx.request_id: h.ctx.saved for _, h, _, _ in members},
        layer_idx=g.layer,
        point=g.point,
        seq_len=off,
        request_id="",
        rows=rows,
        _rows=(plan.positions, idx),
    )
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
    for (r, h, _, _), (_, s, e) in zip(members, rows):
        if r.store is not None:
            where = _where(h, g.layer)
            bad = ~finite[s:e].all()
            seen = r.store.nonfinite.get(where)
            r.store.nonfinite[where] = bad if seen is None else seen | bad
    return spent
