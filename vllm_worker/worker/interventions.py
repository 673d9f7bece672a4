"""Steering beyond addition (`protocol.ops`: ablate, cap, set; phases), the same arithmetic on both paths.

A request's entries at one site apply in the order given. Consecutive additions form one step (norm
matching reads the stream as it was before that run of additions, as plain steering always did); every
other op is one step of its own reading the stream left by the steps before it. Arithmetic is float32 and
the activation is rounded to the model's dtype once, after the last step.

- Python path (`steer_rows`): one request's rows, with the step's device positions for phases and 3-D rows.
- Graph-safe path: each position class of a request at a site (its prompt positions, its generated ones,
  each position a 3-D row names) gets a chain of entries (`chain_entries`: op code, A, B, lo, hi and the
  next entry), which the tap kernel (`graph_kernels`) or its torch twin (`apply_entries`) walks.
  An add entry adds `A + B * |x|`; ablate and cap use A as the unit direction; set writes `A + B * x`
  (B: 1 where the value is kept, 0 where it is written).
- Whole rows (mlp_post, d_mlp wide, carried as d_model-wide pieces): a request's steering at the tap's own
  site is one chain whose every step is `pieces` consecutive entries (piece j of A and B at head + j, op
  flagged `WHOLE`, the pieces after the first also `TAIL`); the row's every piece column points at the head,
  and the program of piece 0 serves the whole row (a projection or norm needs every piece), the others skip
  it. At most `MAX_WHOLE_STEPS` steps: the kernel keeps each step's scalar in registers (longer chains take
  the Python path).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Hashable

import numpy as np
import torch

from vllm_worker.protocol.ops import ABLATE, ADD, CAP, SET
from vllm_worker.protocol.recent import recall, remember

INF = math.inf
WHOLE, TAIL = 8, 16  # op flags of whole-row entries (`protocol.ops` codes are below 8)
OP_MASK = 7
MAX_WHOLE_STEPS = 8  # (the tap kernel's scalars per whole-row chain: `graph_kernels`)


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def _op_step(op: int, x: torch.Tensor, r: torch.Tensor | None, v: torch.Tensor, st: Any) -> torch.Tensor:
    """One non-additive step on float32 rows `x` (`hidden`; the stream is `x + r`); `v`: its rows."""
    s = x if r is None else x + r
    if op == SET:
        keep = st.keep
        new = v if keep is None else v + keep.float() * s
        return new if r is None else new - r
    p = (s * v).sum(dim=-1, keepdim=True)
    if op == ABLATE:
        return x - p * v
    lo = -INF if st.lo is None else st.lo
    hi = INF if st.hi is None else st.hi
    return x + (p.clamp(min=lo, max=hi) - p) * v


def steer_rows(
    steers: list,
    site: int,
    positions: torch.Tensor | None,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    s: int,
    e: int,
) -> None:
    """One request's steering at `site` on rows `s:e`, in the order given (Python path)."""
    x = hidden[s:e].float()
    r = None if residual is None else residual[s:e].float()
    pos = None if positions is None else positions[s:e]
    delta: torch.Tensor | None = None
    norm: torch.Tensor | None = None
    for st in steers:
        row = st.layers.get(site)
        if row is None:
            continue
        mask = None
        if st.span is not None:
            assert pos is not None
            mask = ((pos >= st.span[0]) & (pos < st.span[1])).unsqueeze(1)
        if st.lut is None:
            v = st.vectors[row].unsqueeze(0).float()
        else:
            assert pos is not None
            n = st.lut.shape[0]
            vi = st.lut[pos.clamp(max=n - 1)]
            m = ((pos < n) & (vi >= 0)).unsqueeze(1)
            mask = m if mask is None else mask & m
            v = st.vectors[row].index_select(0, vi.clamp(min=0)).float()
        if st.op == ADD and not st.mul:
            if st.norm_match:
                if norm is None:
                    norm = (x if r is None else x + r).norm(dim=-1, keepdim=True)
                v = _unit(v) * norm
            add = v * st.scale
            if mask is not None:
                add = add * mask
            delta = add if delta is None else delta + add
            continue
        if delta is not None:  # the run of additions before this step
            x, delta, norm = x + delta, None, None
        new = x * v if st.mul else _op_step(st.op, x, r, v, st)
        x = new if mask is None else torch.where(mask, new, x)
    if delta is not None:
        x = x + delta
    hidden[s:e] = x.to(hidden.dtype)


# ---------------------------------------------------------------- the graph-safe path's entries


def _chain(items: list) -> list[tuple[int, torch.Tensor, torch.Tensor, float, float]]:
    """The steps of one position class: `items` = (steer, its row) in order -> entries (op, A, B, lo, hi)."""
    out: list[tuple[int, torch.Tensor, torch.Tensor, float, float]] = []
    a = b = None
    for st, v in items:
        v = v.float()
        if st.op == ADD:
            if a is None:
                a, b = torch.zeros_like(v), torch.zeros_like(v)
            if st.norm_match:
                b = b + _unit(v) * st.scale
            else:
                a = a + v * st.scale
            continue
        if a is not None:
            out.append((ADD, a, b, -INF, INF))
            a = b = None
        if st.op == SET:
            keep = torch.zeros_like(v) if st.keep is None else st.keep.float().cpu()
            out.append((SET, v, keep, -INF, INF))
        else:
            lo = -INF if st.lo is None else st.lo
            hi = INF if st.hi is None else st.hi
            out.append((st.op, v, torch.zeros_like(v), lo, hi))
    if a is not None:
        out.append((ADD, a, b, -INF, INF))
    return out


LAYOUTS_KEPT = 64  # request layouts remembered per table (`chain_entries`), least recently used dropped


def chain_entries(
    table: Any,
    sites: dict[int, int],
    steers: list,
    key_of: Callable[..., Hashable],
    wide: dict[int, list[int]] | None = None,
) -> tuple[dict, list[int]] | None:
    """A request's steering (some of it beyond plain addition) as chains of entries of `table`
    (`graph_entries.SteeringEntries`), per site this stage holds: `{site: (prompt entry, named positions,
    their entries, generated entry, split)}` — rows at positions >= split (its phases' boundary; -1: none)
    take the generated chain. `wide`: mlp_post tap sites whose whole rows the kernel serves -> their
    pieces' sites (each piece site gets the tap's whole-row chains). A chain is keyed by what it is made of
    (`key_of(steer, row, k)` per item), so the table stores one copy of chains several requests (or sites)
    share. None when the table is full.

    The layout (which chains, their keys, which site takes which) depends only on the steering's content
    and fields, so it is remembered per table by that content (`table.layouts`, LRU): a request equal to
    an earlier one costs a lookup and the table's refcounts. The memo holds keys and indexes only, never
    a request's tensors; chains not stored are built from the current request's vectors. The result is
    shared by such requests (read-only)."""
    wide = wide or {}
    local = sorted({l for st in steers for l in st.layers if l in sites or l in wide})
    rkey = (tuple(_steer_key(st, key_of) for st in steers), tuple(local), tuple(len(wide.get(l, ())) for l in local))
    got = recall(table.layouts, rkey)
    if got is None:
        got = _layout(local, steers, key_of, wide)
        remember(table.layouts, rkey, got, LAYOUTS_KEPT)
    specs, layout, last = got
    if not specs:
        return {}, []
    d = table.d
    chains = [(key, functools.partial(_chain_at, steers, items, n, d)) for key, items, n in specs]
    taken = table.add_chains(chains)
    if taken is None:
        return None
    heads, ids = taken
    if last and last[0] == heads:
        return last[1], ids

    def first(i: int) -> int:
        return -1 if i < 0 else heads[i]

    out: dict[int, tuple] = {}
    for targets, default, pos, per_pos, gen, split in layout:
        # (-1: a named position without steps of its own; the plan falls back to the prompt chain)
        ents = np.array([first(c) for c in per_pos], dtype=np.int32)
        ents.flags.writeable = False
        for target in targets:  # (a whole row: every piece's column points at the chain's head)
            out[target] = (first(default), pos, ents, first(gen), split)
    last[:] = [heads, out]
    return out, ids


def _steer_key(st: Any, key_of: Callable[..., Hashable]) -> Hashable:
    """Everything of one steer that `_layout` and `_chain` read: its content (`key_of`) and where it applies."""
    pos = None if st.positions is None else tuple(st.positions)
    return (key_of(st, -1, -1), tuple(st.layers.items()), pos, None if st.span is None else tuple(st.span))


def _n_steps(steers: list, items: list[tuple[int, int, int]]) -> int:
    """How many entries (`_chain`'s steps) a chain of `items` makes: a run of additions is one."""
    n, prev_add = 0, False
    for i, _, _ in items:
        is_add = steers[i].op == ADD
        n += not (is_add and prev_add)
        prev_add = is_add
    return n


def _layout(
    local: list[int], steers: list, key_of: Callable[..., Hashable], wide: dict[int, list[int]]
) -> tuple[list, list, list]:
    """The chains a request's steering makes at `local` sites: (key, items as (steer index, row, k), pieces)
    each, and per site (the sites taking it, prompt chain, named positions, their chains, generated chain,
    split) as indexes into those chains (-1: none); and an empty slot for `chain_entries`' last result. A
    whole-row site (`wide`) with a chain longer than `MAX_WHOLE_STEPS` gets none: its request takes the
    Python path (`python_path.wide_needs_python`)."""
    splits = {st.span[0] if st.span[0] > 0 else st.span[1] for st in steers if st.span is not None}
    split = max(splits) if splits else -1  # (one prompt length per request)
    specs: list[tuple[Hashable, tuple, int]] = []
    layout: list[tuple] = []

    def applies(st: Any, p: int) -> bool:
        return st.span is None or st.span[0] <= p < st.span[1]

    for layer in local:
        pieces = len(wide.get(layer, ()))
        mine = [(i, st, st.layers[layer]) for i, st in enumerate(steers) if layer in st.layers]
        named = sorted({p for _, st, _ in mine if st.positions is not None for p in st.positions})
        prompt_p = 0 if split < 0 else split - 1  # any position of the class does
        classes = [[(i, row, -1) for i, st, row in mine if st.positions is None and applies(st, prompt_p)]]
        if split >= 0:
            classes.append([(i, row, -1) for i, st, row in mine if st.positions is None and applies(st, split)])
        for p in named:
            items = []
            for i, st, row in mine:
                if not applies(st, p):
                    continue
                if st.positions is None:
                    items.append((i, row, -1))
                elif p in st.positions:
                    k = len(st.positions) - 1 - st.positions[::-1].index(p)  # a repeated position: the last row
                    items.append((i, row, k))
            classes.append(items)
        if pieces and any(_n_steps(steers, c) > MAX_WHOLE_STEPS for c in classes):
            continue
        made = []
        for items in classes:
            if not items:
                made.append(-1)
                continue
            key = ("chain", pieces, tuple(key_of(steers[i], row, k) for i, row, k in items))
            specs.append((key, tuple(items), pieces))
            made.append(len(specs) - 1)
        default, gen = made[0], (made[1] if split >= 0 else -1)
        per_pos = made[1 + (split >= 0) :]
        pos = np.array(named, dtype=np.int64)
        pos.flags.writeable = False
        layout.append((tuple(wide[layer]) if pieces else (layer,), default, pos, per_pos, gen, split))
    return specs, layout, []


def _chain_at(
    steers: list, items: tuple, pieces: int, d: int
) -> list[tuple[int, torch.Tensor, torch.Tensor, float, float]]:
    """The entries of one chain (`_layout`'s items) from this request's vectors; `pieces` > 0: a whole row's,
    each step cut into that many d-wide entries (the last padded), flagged `WHOLE` when more than one."""
    steps = _chain([(steers[i], steers[i].vectors[row] if k < 0 else steers[i].vectors[row][k]) for i, row, k in items])
    if not pieces:
        return steps
    out = []
    for op, a, b, lo, hi in steps:
        a, b = (torch.nn.functional.pad(v, (0, pieces * d - v.shape[-1])) for v in (a, b))
        for j in range(pieces):
            flag = 0 if pieces == 1 else WHOLE | (TAIL if j else 0)
            out.append((op | flag, a[j * d : (j + 1) * d], b[j * d : (j + 1) * d], lo, hi))
    return out


def apply_entries(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    rows: torch.Tensor,
    ent: torch.Tensor,
    t: Any,
    pieces: int = 1,
) -> None:
    """What the tap kernel does to `rows` (each with its first entry `ent`), as torch ops (CPU engines);
    `t`: the entry table (`graph_entries.SteeringEntries`); `pieces` > 1: whole rows (`WHOLE` chains), a
    step's A and B the rows of its `pieces` consecutive entries."""
    x = hidden[rows].float()
    r = None if residual is None else residual[rows].float()
    e = ent.long()
    live = torch.arange(len(rows), device=rows.device)
    span = torch.arange(pieces, device=rows.device)
    while live.numel():
        ee = e[live]
        xs = x[live]
        rs = None if r is None else r[live]
        s = xs if rs is None else xs + rs
        w = xs.shape[1]  # d, the narrower last piece of an mlp_post row, or a whole row
        if pieces == 1:
            a = t.A[ee, :w].float()
            b = t.B[ee, :w].float()
        else:
            at = (ee.unsqueeze(1) + span).flatten()
            a = t.A[at].reshape(len(ee), -1)[:, :w].float()
            b = t.B[at].reshape(len(ee), -1)[:, :w].float()
        op = (t.op[ee] & OP_MASK).unsqueeze(1)
        kinds = set(op.unique().tolist())  # (only the ops present are computed: the same values, fewer ops)
        got: dict[int, torch.Tensor] = {}
        if ADD in kinds:
            nb = s.norm(dim=-1, keepdim=True) * (t.bflag[ee] != 0).unsqueeze(1)
            got[ADD] = xs + (a + b * nb) * t.gate[ee].unsqueeze(1)  # gate: 1, or a probe action's (0 until fired)
        if SET in kinds:
            written = a + b * s
            got[SET] = written if rs is None else written - rs
        if kinds - {ADD, SET}:  # ablate / cap
            p = (s * a).sum(dim=-1, keepdim=True)
            q = torch.where(op == CAP, torch.clamp(p, min=t.lo[ee].unsqueeze(1), max=t.hi[ee].unsqueeze(1)), 0.0)
            got[CAP] = xs + (q - p) * a
        if len(got) == 1:
            x[live] = next(iter(got.values()))
        else:
            other = next(iter(got.values()))  # (never selected: stands in for an op no row has)
            moved = got.get(CAP, other)
            x[live] = torch.where(op == ADD, got.get(ADD, other), torch.where(op == SET, got.get(SET, other), moved))
        e[live] = t.nxt[ee].long()
        live = live[e[live] >= 0]
    hidden[rows] = x.to(hidden.dtype)
