"""Batch assembly: a fetch's captures copied from the step arenas into result-pool regions with a few
large index copies per arena chunk — every request of the fetch at once — instead of a dozen small
copies per request and chunk.

Why: per-request assembly spent its time in Python around the copies (tens of thousands of numpy calls
for an all-layer batch), and threads made it worse by fighting over the GIL
(docs/decisions.md). Here each arena chunk (steps, rows, d) is cut into runs of
adjacent columns that belong to this fetch; a run is copied with one numpy fancy-index assignment
(`dst_rows[index (steps, m)] = chunk[:, run]`, no temporary: the source is a view) that releases the GIL,
so a few threads really run in parallel. A request's region is aligned to a row of its segment, so the
destination of (request, layer, position) is one row number.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from vllm_worker.protocol import errors
from vllm_worker.protocol.wire import dtype_name
from vllm_worker.transport import row_layout
from vllm_worker.transport.result_pool import ResultPool, host_array, np_dtype

BLOCK_BYTES = 64 << 20  # one copy job at most (threads take jobs)


@dataclass
class FetchRegion:
    """Where one request's captures go: rows `base + r0[slot] + position * stride[slot]` of its segment
    (`row_layout`)."""

    payload: dict
    mine: list[int]
    n_pos: int
    path: str
    base: int
    region: tuple
    d: int
    dtype: torch.dtype
    nbytes: int
    r0: np.ndarray
    stride: np.ndarray


def note_missing(payload: dict, mine: list[int], filled: np.ndarray) -> None:
    """Positions of a request that never ran a forward pass (`filled[layer, position]` False): its error,
    never a silent hole in its tensor."""
    missing = [(l, int(np.flatnonzero(~filled[i])[0])) for i, l in enumerate(mine) if not filled[i].all()]
    if missing:
        payload.setdefault(
            "error",
            errors.failure(
                "internal",
                f"positions never ran a forward pass (layer, first missing position): {missing}",
                "assembling results",
            ),
        )


def pool_result(
    payload: dict, pool: ResultPool, region: tuple, nbytes: int, dtype: torch.dtype, shape: list[int], mine: list[int]
) -> dict:
    """`payload` pointing at a request's captures in the result pool (the frontend maps them there), laid out
    as `row_layout` says (`INTERLEAVED` when some output's rows interleave)."""
    if row_layout.interleaved(mine):
        payload[row_layout.INTERLEAVED] = True
    path, off, size = region[0], region[1], region[2]
    payload.update(
        {
            "layers": mine,
            "pool": {
                "path": path,
                "offset": off,
                "size": size,
                "nbytes": nbytes,
                "dtype": dtype_name(dtype),
                "shape": shape,
                "serial": pool.serial(path, off),
            },
        }
    )
    return payload


def _runs(cols: np.ndarray, code: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) index ranges of `cols` (sorted) whose values are consecutive and whose `code` (the
    segment their request's region is in) is the same."""
    if len(cols) == 0:
        return []
    breaks = np.flatnonzero((np.diff(cols) != 1) | (np.diff(code) != 0)) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(cols)]])
    return list(zip(starts.tolist(), ends.tolist()))


def assemble(
    items: list[tuple[dict, Any, int, list[int], dict[int, int]]],
    pool: ResultPool,
    threads: int,
    pool_executor: Callable[[int], Any],
    timings: dict,
) -> list[dict | None]:
    """`items`: (payload so far, store, n_pos, layers this rank holds, slot -> output index) of requests
    with captures. Fills each payload with its pool region (or leaves it None in the returned list when
    the pool had no room: the caller assembles that one as bytes)."""
    t0 = time.perf_counter()
    dests: list[FetchRegion | dict | None] = []
    # arena chunk -> (data, pos, filled steps, [(first column, n, dest, output slot)])
    chunks: dict[int, tuple[torch.Tensor, torch.Tensor, int, list]] = {}
    rows_of: dict[tuple[str, torch.dtype, int], np.ndarray] = {}
    for payload, st, n_pos, mine, out_of_slot in items:
        segs = [seg for seg in st.segments if seg.log.arena is not None and seg.slot in out_of_slot]
        first = next((ch for seg in segs for ch in seg.log.arena.chunks if ch[2]), None)
        if first is None:
            payload.setdefault("error", errors.failure("internal", "no positions were captured", "assembling results"))
            dests.append(payload)  # done: nothing to copy
            continue
        d, dtype = first[0].shape[-1], first[0].dtype
        row = d * first[0].element_size()
        nbytes = len(mine) * n_pos * row
        region = pool.alloc(nbytes, st.expected, align=row)
        st.expected = 0
        if region is None:
            dests.append(None)
            continue
        path, off = region[0], region[1]
        dest = FetchRegion(
            payload, mine, n_pos, path, off // row, region, d, dtype, nbytes, *row_layout.layout(mine, n_pos)
        )
        dests.append(dest)
        if (path, dtype, d) not in rows_of:
            rows_of[(path, dtype, d)] = pool.rows(path, dtype, d)
        for seg in segs:
            for data, pos, f in seg.log.arena.chunks:
                if f:
                    entry = chunks.setdefault(id(data), (data, pos, f, []))
                    entry[3].append((seg.log.col + seg.offset, seg.n, dest, out_of_slot[seg.slot]))
    t1 = time.perf_counter()
    timings["alloc_s"] += t1 - t0

    jobs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    filled: dict[str, np.ndarray] = {}
    for data, pos, f, uses in chunks.values():
        u = np.array(
            [(c, n, dest.base + dest.r0[slot], dest.n_pos, dest.stride[slot]) for c, n, dest, slot in uses],
            dtype=np.int64,
        ).reshape(-1, 5)
        paths = sorted({dest.path for _, _, dest, _ in uses})
        code_of = {p: i for i, p in enumerate(paths)}
        u_code = np.array([code_of[dest.path] for _, _, dest, _ in uses], dtype=np.int64)
        order = np.argsort(u[:, 0], kind="stable")
        u, u_code = u[order], u_code[order]
        lens = u[:, 1]
        starts = np.cumsum(lens) - lens
        cols = np.arange(int(lens.sum())) + np.repeat(u[:, 0] - starts, lens)  # arena columns, sorted
        base = np.repeat(u[:, 2], lens)  # destination row of position 0, per column
        npos = np.repeat(u[:, 3], lens)
        stride = np.repeat(u[:, 4], lens)
        seg_code = np.repeat(u_code, lens)
        src_np = host_array(data)  # (steps, rows, d)
        pos_np = pos.numpy()[:f]
        d = data.shape[-1]
        step_bytes_per_col = d * data.element_size()
        for a, b in _runs(cols, seg_code):
            c0, c1 = int(cols[a]), int(cols[b - 1]) + 1
            path = paths[int(seg_code[a])]
            dst_rows = rows_of[(path, data.dtype, d)]
            p = pos_np[:, c0:c1]
            dst = base[None, a:b] + p * stride[None, a:b]
            ok = (p >= 0) & (p < npos[None, a:b])
            fill = filled.setdefault(path, np.zeros(dst_rows.shape[0], dtype=bool))
            if ok.all():
                fill[dst] = True
                per_job = max(1, BLOCK_BYTES // max(1, (c1 - c0) * step_bytes_per_col))
                for s0 in range(0, f, per_job):
                    jobs.append((dst_rows, dst[s0 : s0 + per_job], src_np[s0 : min(f, s0 + per_job), c0:c1]))
            else:  # some positions are outside the result (never expected): copy only the others
                fill[dst[ok]] = True
                jobs.append((dst_rows, dst[ok], src_np[:f, c0:c1][ok]))
    t2 = time.perf_counter()

    def run(job: tuple) -> None:
        dst_rows, idx, values = job
        dst_rows[idx] = values

    if threads > 1 and len(jobs) > 1:
        with pool_executor(threads) as executor:
            list(executor.map(run, jobs))
    else:
        for job in jobs:
            run(job)
    t3 = time.perf_counter()
    timings["index_s"] += t2 - t1
    timings["copy_s"] += t3 - t2

    out: list[dict | None] = []
    for got_dest, (payload, st, n_pos, mine, _) in zip(dests, items):
        if not isinstance(got_dest, FetchRegion):
            out.append(got_dest)  # a finished payload, or None: no room in the pool
            continue
        dest = got_dest
        path, off, size, arr = dest.region
        d, dtype = dest.d, dest.dtype
        done = filled.get(path)
        at = row_layout.rows(mine, n_pos, n_pos)  # (output, position) -> row of the region
        got = done[dest.base + at] if done is not None else np.zeros((len(mine), n_pos), dtype=bool)
        if not got.all():
            arr.view(np_dtype(dtype)).reshape(len(mine) * n_pos, d)[at[~got]] = 0  # never another request's old rows
            note_missing(payload, mine, got)
        out.append(pool_result(payload, pool, dest.region, dest.nbytes, dtype, [len(mine), n_pos, d], mine))
    return out
