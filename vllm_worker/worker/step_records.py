"""Per-step outputs that stay on the device until fetched (probe scores, SAE features), filed with a
constant amount of work per step: one record per site and batch composition holds every step's outputs
for all of that composition's rows; each request keeps spans (its rows, its columns) into the records it
took part in, made once per composition, and its part is cut out only when it is fetched.

A record's steps live in chunks of (steps, rows, columns) tensors whose step count doubles up to
`MAX_CHUNK_STEPS` (as the capture arenas: `request_results.StepArena`); a step writes its outputs straight
into its chunk row (`next`). Positions stay where the step has them: host arrays on the graph-safe path,
device tensors on the Python path — no copy between the two in a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

Block = tuple[int, torch.dtype]  # (columns, dtype) of one named output of a record


class StepRecord:
    """One site's outputs over the steps of one batch composition: positions (steps, rows) and named
    blocks (steps, rows, columns)."""

    __slots__ = ("rows", "blocks", "device", "chunks", "groups", "event", "_host_pos", "_steps")
    MAX_CHUNK_STEPS = 64

    def __init__(self, rows: int, blocks: dict[Any, Block], device: torch.device, groups: int = 1) -> None:
        self.rows, self.blocks, self.device = rows, blocks, device
        self.chunks: list[list] = []  # [positions (steps, rows), {key: (steps, rows, cols)}, steps filled]
        # `next` hands out each step's blocks as (groups, rows / groups, cols) views (sites scored together)
        self.groups = groups
        # the last chunk's positions as a numpy array over its memory (host positions), and each of its
        # steps' views per block, made with the chunk: a step writes there without a torch call
        self._host_pos: np.ndarray | None = None
        self._steps: list[dict[Any, torch.Tensor]] = []
        self.event: Any = None  # (`mark`)

    def next(self, pos: np.ndarray | torch.Tensor) -> dict[Any, torch.Tensor]:
        """Record this step's positions (rows,); returns its (rows, cols) views per block to write into
        ((groups, rows / groups, cols) with `groups`; the same dict object is not handed out twice)."""
        if not self.chunks or self.chunks[-1][2] == self.chunks[-1][0].shape[0]:
            c = min(self.MAX_CHUNK_STEPS, 1 << len(self.chunks))
            pos_dev = pos.device if isinstance(pos, torch.Tensor) else torch.device("cpu")
            positions = torch.empty((c, self.rows), dtype=torch.int64, device=pos_dev)
            blocks = {
                k: torch.empty((c, self.rows, n), dtype=dt, device=self.device) for k, (n, dt) in self.blocks.items()
            }
            self.chunks.append([positions, blocks, 0])
            self._host_pos = positions.numpy() if pos_dev.type == "cpu" else None
            g = self.groups
            views = {k: (t if g == 1 else t.view(c, g, -1, t.shape[-1])).unbind(0) for k, t in blocks.items()}
            self._steps = [{k: v[i] for k, v in views.items()} for i in range(c)]
        ch = self.chunks[-1]
        k = ch[2]
        ch[2] += 1
        if isinstance(pos, torch.Tensor):
            ch[0][k].copy_(pos, non_blocking=True)
        else:
            host = self._host_pos
            assert host is not None  # (a record's positions stay on one side: host arrays or device tensors)
            host[k] = pos
        return self._steps[k]

    def mark(self) -> None:
        """After a step's writes here are queued (graph-safe path, CUDA): an event behind them, recorded
        again each step, so that `ran` tells without waiting whether every step written here has run."""
        ev = self.event
        if ev is None:
            ev = self.event = torch.cuda.Event()
        ev.record()

    def ran(self) -> bool:
        """Every step written here has run on the device; False when not known (never `mark`ed)."""
        return self.event is not None and bool(self.event.query())

    @property
    def steps(self) -> int:
        return sum(ch[2] for ch in self.chunks)


@dataclass(eq=False)
class Span:
    """A request's part of a record: rows r0:r1 of every step, columns `cols` of block `key` (a slice, or
    column indices)."""

    record: StepRecord
    r0: int
    r1: int
    key: Any
    cols: slice | torch.Tensor

    def pieces(self, key: Any = None, cache: dict | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[(positions (m,), values (m, k))] on the host, steps in order; `key`: another block, all of its
        columns (e.g. top-k indices beside their values). `cache` (one fetch's): the rows of a record read
        once for every span of them (a request's probes at one site share its rows): one copy to the host."""
        k = self.key if key is None else key
        ck = (id(self.record), self.r0, self.r1, k)
        got = None if cache is None else cache.get(ck)
        if got is None and cache is not None and cache.get(WHOLE_RECORDS):
            got = self._rows_of_whole(k, cache)
            if got is None:
                return []
            cache[ck] = got  # the request's other probes at this site read the same rows
        if got is None:
            parts = [
                (pos[:f, self.r0 : self.r1], blocks[k][:f, self.r0 : self.r1])
                for pos, blocks, f in self.record.chunks
                if f
            ]
            if not parts:
                return []
            got = (
                torch.cat([p.reshape(-1) for p, _ in parts]).to("cpu", torch.int64),
                torch.cat([v.reshape(-1, v.shape[-1]) for _, v in parts]).to("cpu"),
            )
            if cache is not None:
                cache[ck] = got
        pos, vals = got
        if key is None:
            vals = vals[:, self.cols] if isinstance(self.cols, slice) else vals.index_select(1, self.cols)
        return [(pos, vals)]

    def _whole(self, k: Any, cache: dict) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray | None] | None:
        """The record's positions (steps, rows) and block `k` (steps, rows, columns) on the host, as tensors
        and as numpy arrays over them, copied once per `cache` (one fetch or progress RPC: one copy per record
        for every request in it, not one per request); None when nothing was filed."""
        ck = (id(self.record), k)
        whole = cache.get(ck)
        if whole is None:
            parts = [(pos[:f], blocks[k][:f]) for pos, blocks, f in self.record.chunks if f]
            if not parts:
                return None
            pos = torch.cat([p for p, _ in parts]).to("cpu", torch.int64)
            vals = torch.cat([v for _, v in parts]).to("cpu")
            np_vals = vals.numpy() if vals.dtype in (torch.float32, torch.int64) else None  # (numpy has no bf16)
            whole = cache[ck] = (pos, vals, pos.numpy(), np_vals)
        return whole

    def _rows_of_whole(self, k: Any, cache: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This span's rows of block `k`, cut from the record's host copy (`_whole`)."""
        whole = self._whole(k, cache)
        if whole is None:
            return None
        pos, vals = whole[0], whole[1]
        return pos[:, self.r0 : self.r1].reshape(-1), vals[:, self.r0 : self.r1].reshape(-1, vals.shape[-1])

    def host_copy(self, cache: dict) -> tuple[np.ndarray, np.ndarray]:
        """The record's (positions (steps, rows), block (steps, rows, columns)) host copy of this span's
        float32 / int64 block as numpy arrays (`_whole`), for gathers over many spans of it at once."""
        whole = self._whole(self.key, cache)
        assert whole is not None and whole[3] is not None, "host_copy: a filed float32 / int64 block"
        return whole[2], whole[3]

    def filed(self, cache: dict) -> bool:
        """Whether the record has rows of this span's block (`_whole` is not None: read to the host once)."""
        return self._whole(self.key, cache) is not None

    def host_positions(self, cache: dict) -> np.ndarray | None:
        """This span's positions (m,) over the record's host copy (`_whole`); None when nothing was filed."""
        whole = self._whole(self.key, cache)
        return None if whole is None else whole[2][:, self.r0 : self.r1].reshape(-1)

    def host_values(self, cache: dict) -> np.ndarray | None:
        """This span's values (m, k): its rows and columns of the record's host copy, as numpy slices (a
        request's part is a few array slices, not device reads and torch calls per request). Float32 / int64
        blocks (probe scores); None when nothing was filed."""
        whole = self._whole(self.key, cache)
        if whole is None:
            return None
        vals = whole[3]
        assert vals is not None, "host_values reads float32 / int64 blocks"
        v = vals[:, self.r0 : self.r1].reshape(-1, vals.shape[-1])
        return v[:, self.cols] if isinstance(self.cols, slice) else v[:, self.cols.cpu().numpy()]


WHOLE_RECORDS = "whole_records"  # a `cache` key: read whole records once for many requests (`Span.pieces`)


def latest(pieces: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """The pieces' (positions, values...) on the host, positions sorted, a position filed twice (a preempted
    request's recompute) keeping its last one (pieces come in step order)."""
    one = len(pieces) == 1
    pos = pieces[0][0].to("cpu", torch.int64) if one else torch.cat([p[0].to("cpu", torch.int64) for p in pieces])
    if len(pos) < 2 or bool((pos[1:] > pos[:-1]).all()):  # steps in order: positions usually rise already
        if one:
            return (pos, *(v.to("cpu") for v in pieces[0][1:]))
        return (pos, *(torch.cat([p[i] for p in pieces]).to("cpu") for i in range(1, len(pieces[0]))))
    order = torch.sort(pos, stable=True).indices
    pos = pos[order]
    keep = torch.ones(len(pos), dtype=torch.bool)
    keep[:-1] = pos[1:] != pos[:-1]
    rest = [torch.cat([p[i] for p in pieces]).to("cpu")[order][keep] for i in range(1, len(pieces[0]))]
    return (pos[keep], *rest)


def latest_order(pos: np.ndarray) -> np.ndarray | None:
    """`latest`'s row order for numpy positions (`Span.host_positions`): the rows that sort them (stable),
    a position filed twice keeping its last row; None when they already rise (steps in order: usually)."""
    if len(pos) < 2 or bool((pos[1:] > pos[:-1]).all()):
        return None
    idx = np.argsort(pos, kind="stable")
    sorted_pos = pos[idx]
    keep = np.ones(len(pos), dtype=bool)
    keep[:-1] = sorted_pos[1:] != sorted_pos[:-1]
    return idx[keep]
