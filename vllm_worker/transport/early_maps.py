"""Early assembly's column maps, pure numpy: where each arena column's rows go (for the copier's host
copies: `block_map`, `jobs`; for the GPU's direct writes: `direct_map`), the copies cut for threads
(`split`, `run`), and a region's missing rows completed from the arenas (`complete`).

Why blocks: in a batch where every request captures the same layers, one segment's requests are the same
run of columns at every layer, so one block covers them all and a chunk's rows for it are one strided view
(no gather, no temporary), copied with one numpy call per copy thread — few, large calls, each releasing
the GIL (`early._batch` says what the step loop pays for every take-back)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from vllm_worker.transport.early_regions import EarlyRegion
from vllm_worker.transport.result_pool import host_array


def block_map(n_cols: int, cols: tuple | None) -> tuple | None:
    """From `user_columns`' answer: per column the destination row of position 0 and its positions'
    bound, the targets (segment rows, written flags) and the columns as blocks `[target, first column, w,
    gap, m]` (`m` runs of `w` adjacent columns, `gap` columns apart, one target), or None (no column goes to
    a live region)."""
    key = np.full(n_cols, -1, dtype=np.int64)
    base = np.zeros(n_cols, dtype=np.int64)
    npos = np.zeros(n_cols, dtype=np.int64)
    stride = np.ones(n_cols, dtype=np.int64)
    targets: list[tuple[np.ndarray, np.ndarray]] = []
    if cols is not None:
        idx, _, rows, bounds, codes, _, firsts, strides = cols
        base[idx], npos[idx], key[idx], stride[idx] = rows, bounds, codes, strides
        targets = [(e.rows, e.fill) for e in firsts]
    if not targets:
        return None
    edges = np.flatnonzero(np.diff(key)) + 1
    starts = np.concatenate([[0], edges]).tolist()
    ends = np.concatenate([edges, [n_cols]]).tolist()
    blocks: list[list[int]] = []  # [target, first column, w, gap, m]
    latest: dict[int, list[int]] = {}
    for a, b in zip(starts, ends):
        k = int(key[a])
        if k < 0:
            continue
        last = latest.get(k)  # this target's latest block (targets interleave within a layer)
        if last is not None and last[2] == b - a:
            if last[4] == 1 and a > last[1]:
                last[3], last[4] = a - last[1], 2
                continue
            if a == last[1] + last[4] * last[3]:
                last[4] += 1
                continue
        blocks.append([k, a, b - a, 0, 1])
        latest[k] = blocks[-1]
    return base, npos, targets, [tuple(b) for b in blocks], stride


def direct_map(n_cols: int, cols: tuple | None, d: int, esize: int) -> tuple | None:
    """From `user_columns`' answer for an arena's direct members: per column the element offset of position
    0's row from the lowest target segment, its positions' bound (0: not written), its row in its segment
    and which segment's marks it sets; None when no member is left."""
    if cols is None:
        return None
    idx, n_arr, rows, bounds, codes, who, firsts, strides = cols
    origin = min(e.addr for e in who)
    end = max(e.addr + e.rows.shape[0] * e.row for e in who)
    start = np.array([(e.addr - origin) // esize for e in who], dtype=np.int64)
    off0 = np.zeros(n_cols, dtype=np.int64)
    npos = np.zeros(n_cols, dtype=np.int64)
    row0 = np.zeros(n_cols, dtype=np.int64)
    stride = np.ones(n_cols, dtype=np.int64)
    tkey = np.full(n_cols, -1, dtype=np.int64)
    off0[idx] = np.repeat(start, n_arr) + rows * d
    npos[idx] = bounds
    row0[idx] = rows
    stride[idx] = strides
    tkey[idx] = codes
    # per target segment its columns (None: it has every written column)
    marks = [(e.fill, None if len(firsts) == 1 else np.flatnonzero(tkey == k)) for k, e in enumerate(firsts)]
    return origin, end - origin, off0, npos, row0, marks, stride


def mark_direct(got: tuple, pos: np.ndarray, d: int) -> tuple[np.ndarray, int, int]:
    """This step's element offsets (-1: not written) under `direct_map`'s answer, its rows marked written:
    (offsets, origin, span)."""
    origin, span, off0, npos, row0, marks, stride = got
    p = pos.astype(np.int64, copy=False)
    ok = (p >= 0) & (p < npos)
    at = p * stride  # rows from position 0's (`row_layout`)
    offs = off0 + at * d
    offs[~ok] = -1
    for fill, cols in marks:  # per target segment: its columns' rows at this step's positions
        if cols is None:
            fill[(row0 + at)[ok]] = True
        else:
            fill[(row0[cols] + at[cols])[ok[cols]]] = True
    return offs, origin, span


def jobs(chunk: list, s0: int, s1: int, cmap: tuple, out: list, marks: list) -> int:
    """Copy jobs for steps s0:s1 of one arena chunk, one per block; returns their bytes. A job is
    (segment rows, destination rows (steps, m, w), the source rows (steps, m, w, d): a strided view).
    `marks`: (segment's written-rows flags, rows) to set once the copies are done (a batch that fails
    halfway marks nothing: `finish` completes those rows from the arenas)."""
    base, npos, targets, blocks, stride = cmap
    data, pos = chunk[0], chunk[1]
    a3 = host_array(data)[s0:s1]  # (steps, columns, d)
    p = pos.numpy()[s0:s1]
    row = data.shape[-1] * data.element_size()
    total = 0
    for k, c0, w, gap, m in blocks:
        rows, fill = targets[k]
        # the block's columns only (gaps dropped): the column axis becomes (m, w)
        pb = block(p, 1, c0, w, gap, m)  # (steps, m, w)
        bb, nb = block(base, 0, c0, w, gap, m), block(npos, 0, c0, w, gap, m)  # (m, w)
        src = block(a3, 1, c0, w, gap, m)  # (steps, m, w, d)
        dst = bb + pb * block(stride, 0, c0, w, gap, m)  # (steps, m, w) (`row_layout`)
        ok = (pb >= 0) & (pb < nb)
        if ok.all():
            marks.append((fill, dst))
            out.append((rows, dst, src))
            total += dst.size * row
        else:  # positions outside the result (never expected): only the others
            marks.append((fill, dst[ok]))
            out.append((rows, dst[ok], src[ok]))
            total += int(ok.sum()) * row
    return total


def user_columns(states: list, keep: Callable[[EarlyRegion], bool], by: Callable[[EarlyRegion], Any]) -> tuple | None:
    """One Python pass over an arena's users `(first column, columns, their live EarlyRegion or None, slot)`, numpy for the
    columns (an all-layer batch has 32 users per request: a slice assignment per user took ~27 ms per arena
    on CPU). The users kept: those whose state is a live `EarlyRegion` holding their slot that `keep` accepts.
    Returns (their columns; per user its column count; per column its region's row of position 0, its
    positions' bound and its target's code — regions grouped by `by(dest)`; per user its EarlyRegion; one EarlyRegion per
    target, in code order; per column the rows between its positions: `row_layout`), or None when no user is kept."""
    cols: list[int] = []
    ns: list[int] = []
    rows: list[int] = []
    strides: list[int] = []
    codes: list[int] = []
    who: list[EarlyRegion] = []
    firsts: list[EarlyRegion] = []
    code: dict[int, int] = {}
    for col, n, e, slot in states:
        if e is None or e.dead:
            continue
        i = e.out_of_slot.get(slot)
        if i is None or not keep(e):
            continue
        assert e.rows is not None and e.fill is not None  # set with the region
        k = code.get(id(by(e)))
        if k is None:
            k = code[id(by(e))] = len(firsts)
            firsts.append(e)
        cols.append(col)
        ns.append(n)
        rows.append(e.base + int(e.r0[i]))
        strides.append(int(e.stride[i]))
        codes.append(k)
        who.append(e)
    if not cols:
        return None
    n_arr = np.array(ns, dtype=np.int64)
    idx = np.repeat(np.array(cols, dtype=np.int64) - np.cumsum(n_arr) + n_arr, n_arr) + np.arange(int(n_arr.sum()))

    def per_column(values: list[int]) -> np.ndarray:
        return np.repeat(np.array(values, dtype=np.int64), n_arr)

    bounds = per_column([e.n_max for e in who])
    return idx, n_arr, per_column(rows), bounds, per_column(codes), who, firsts, per_column(strides)


def complete(region: np.ndarray, at: np.ndarray, got: np.ndarray, segs: list, out_of_slot: dict, n_pos: int) -> None:
    """Rows of `region` (rows, d) not written (`got[out, position]` False; `at[out, position]`: its row)
    copied from the request's arena rows (the fetch-time path's source), marked in `got`."""
    for s in segs:
        i = out_of_slot[s.slot]
        for pos, rows in s.log.arena.parts(s.log.col + s.offset, s.n):
            p = host_array(pos).ravel()
            src = host_array(rows).reshape(len(p), -1)
            keep = (p >= 0) & (p < n_pos)
            keep[keep] = ~got[i, p[keep]]
            if keep.any():
                region[at[i, p[keep]]] = src[keep]
                got[i, p[keep]] = True


def block(x: np.ndarray, axis: int, c0: int, w: int, gap: int, m: int) -> np.ndarray:
    """A view of `x` whose column `axis` is replaced by (m, w): runs of `w` columns from `c0`, `gap` apart."""
    st = x.strides[axis]
    return np.lib.stride_tricks.as_strided(
        x[(slice(None),) * axis + (slice(c0, None),)],
        x.shape[:axis] + (m, w) + x.shape[axis + 1 :],
        x.strides[:axis] + (gap * st, st) + x.strides[axis + 1 :],
    )


def split(todo: list, parts: int) -> list[tuple]:
    """The jobs cut into about `parts` pieces in all (a thread each), along their longest leading axis."""
    total = sum(j[1].size for j in todo)
    if not total:
        return []
    per = max(1, -(-total // parts))
    out = []
    for rows, idx, src in todo:
        n = max(1, -(-idx.size // per))  # pieces for this job
        axis = int(np.argmax(idx.shape))  # (steps, m, w) or, for the rare partial job, (rows,)
        length = idx.shape[axis]
        step = max(1, -(-length // n))
        for a in range(0, length, step):
            sl = (slice(None),) * axis + (slice(a, a + step),)
            out.append((rows, idx[sl], src[sl]))
    return out


def run(part: tuple) -> None:
    """One piece: one numpy index copy from a view (no temporary), which releases the GIL for its length."""
    rows, idx, src = part
    rows[idx] = src
