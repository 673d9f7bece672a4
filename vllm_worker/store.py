"""Where results wait in a worker until the frontend fetches them: captures (leaving the GPU while
generation goes on), hook state and the first failure of each request.

On CUDA a step's captures are gathered into one device tensor and copied to pinned host memory on a
side stream that waits for the step's kernels: no synchronisation in the step, and the device copy is
released as soon as the transfer ends (`record_stream`). Only a fetch waits for transfers in flight.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .plan import StepPlan
from . import shm
from .wire import dtype_name, tensor_to_bytes

logger = logging.getLogger("vllm_worker")

# Captures kept in the worker until fetched. Past the cap the oldest are dropped and a later fetch of
# them reports it (an error, never a silent empty result).
MAX_STORED_BYTES = int(float(os.environ.get("VLLM_LENS_MAX_STORED_GB", "8")) * (1 << 30))


class CaptureLog:
    """The captured rows of one layer for every step run with one plan (one batch composition): a
    block per step, shared by the plan's requests; each request reads its own row range (`Segment`).
    Filing a step is O(layers), not O(requests)."""

    __slots__ = ("blocks", "pos", "refs", "nbytes", "_stacked")

    def __init__(self) -> None:
        self.blocks: list[torch.Tensor] = []  # host (rows, d), pinned while a copy may be in flight
        self.pos: list[torch.Tensor] = []  # host (rows,) absolute positions
        self.refs = 0  # segments still to be fetched or dropped
        self.nbytes = 0
        self._stacked: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def rows(self, offset: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, rows) of one request's range across every step. Blocks of equal shape (decode
        steps) are stacked once, so each request is one slice instead of one per step; the blocks then
        become views of the stack (no second copy is kept)."""
        bs = self.blocks
        if self._stacked is None or self._stacked[0] != len(bs):
            if len(bs) > 1 and all(b.shape == bs[0].shape for b in bs):
                sb, sp = torch.stack(bs), torch.stack(self.pos)
                self.blocks, self.pos = list(sb.unbind(0)), list(sp.unbind(0))
                self._stacked = (len(bs), sp, sb)
        if self._stacked is not None and self._stacked[0] == len(self.blocks):
            _, sp, sb = self._stacked
            return sp[:, offset:offset + n].reshape(-1), sb[:, offset:offset + n].reshape(-1, sb.shape[-1])
        return (torch.cat([p[offset:offset + n] for p in self.pos]),
                torch.cat([b[offset:offset + n] for b in self.blocks]))


@dataclass
class Segment:
    log: CaptureLog
    slot: int  # index of the layer in the request's capture list
    offset: int  # first row of the request inside each of the log's blocks
    n: int


@dataclass
class Store:
    """Everything a request hands back: captures, hook state, and the first failure."""

    layers: list[int]
    segments: list[Segment] = field(default_factory=list)
    saved: list[dict] = field(default_factory=list)
    error: str | None = None


class CaptureStore:
    def __init__(self, device: torch.device) -> None:
        self._stores: dict[tuple[str, int], Store] = {}
        self._evicted: set[str] = set()
        self.stored_bytes = 0
        self.lock = threading.Lock()
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __len__(self) -> int:
        return len(self._stores)

    def add(self, key: str, child: int, store: Store) -> None:
        with self.lock:
            self._stores[(key, child)] = store

    # ------------------------------------------------------------ per plan / per step

    def open_plan(self, plan: StepPlan) -> None:
        """A new batch composition: one log per captured layer, one segment per (request, layer)."""
        plan.logs = {}
        with self.lock:
            for layer, (_, items) in plan.capture.items():
                log = plan.logs[layer] = CaptureLog()
                off = 0
                for r, s, e in items:
                    r.store.segments.append(Segment(log, r.capture_slot[layer], off, e - s))
                    log.refs += 1
                    off += e - s

    def _to_host(self, dev: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.side is None:
            return dev.to("cpu"), pos.to("cpu")
        side = self.side
        side.wait_stream(torch.cuda.current_stream(dev.device))
        with torch.cuda.stream(side):
            host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
            host.copy_(dev, non_blocking=True)
            hpos = torch.empty(pos.shape, dtype=pos.dtype, pin_memory=True)
            hpos.copy_(pos, non_blocking=True)
        dev.record_stream(side)
        pos.record_stream(side)
        return host, hpos

    def finish_step(self, plan: StepPlan) -> None:
        """File this step's captured rows (Python path: one device->host copy per step)."""
        dev = torch.cat([t for _, t in plan.captured])
        all_idx = torch.cat([plan.capture[l][0] for l, _ in plan.captured])
        host, pos_host = self._to_host(dev, plan.positions.index_select(0, all_idx))
        self.file_step(plan, host, pos_host, [(layer, t.shape[0]) for layer, t in plan.captured])

    def file_step(self, plan: StepPlan, host: torch.Tensor, pos_host: torch.Tensor,
                  sizes: list[tuple[int, int]]) -> None:
        """File a step's captured rows, `host` (possibly still being copied; `fetch` waits), layer by
        layer in `sizes` order: O(layers) Python, whatever the number of requests."""
        off = 0
        with self.lock:
            for layer, size in sizes:
                log = plan.logs[layer]
                log.blocks.append(host[off:off + size])
                log.pos.append(pos_host[off:off + size])
                nb = size * host.shape[-1] * host.element_size()
                log.nbytes += nb
                self.stored_bytes += nb
                off += size
            self._evict_if_needed()

    def _release(self, st: Store) -> None:
        for seg in st.segments:
            seg.log.refs -= 1
            if seg.log.refs == 0:
                self.stored_bytes -= seg.log.nbytes
                seg.log.blocks, seg.log.pos, seg.log.nbytes, seg.log._stacked = [], [], 0, None
        st.segments = []

    def _evict_if_needed(self) -> None:
        while self.stored_bytes > MAX_STORED_BYTES and self._stores:
            key = next(iter(self._stores))
            self._release(self._stores.pop(key))
            self._evicted.add(key[0])
            logger.error("inspect-lens: capture store over VLLM_LENS_MAX_STORED_GB; dropped request %s", key[0])

    # ------------------------------------------------------------ fetch

    def fetch(self, wanted: list[tuple[str, dict[int, int]]], reporting: bool,
              layer_ids: list[int], assemble_saved: Any, use_shm: bool = False) -> dict[str, Any]:
        """{key: {child: payload}} for this rank's layers; pops what it returns. A rank that does not
        report (TP rank > 0: hooks ran there too, on the same replicated stream) only drops. `use_shm`:
        capture tensors go through shared-memory files (see `shm`)."""
        out: dict[str, Any] = {}
        if self.side is not None:
            self.side.synchronize()
        with self.lock:
            for key, children in wanted:
                if reporting and key in self._evicted:
                    self._evicted.discard(key)
                    out[key] = {"error": "captures were dropped: the worker's store exceeded "
                                         "VLLM_LENS_MAX_STORED_GB before they were fetched"}
                    continue
                per_child = {}
                for child, n_pos in children.items():
                    st = self._stores.pop((key, int(child)), None)
                    if st is None:
                        continue
                    if reporting:
                        per_child[int(child)] = _assemble(st, int(n_pos), layer_ids, assemble_saved, use_shm)
                    self._release(st)
                if per_child:
                    out[key] = per_child
        return out

    def drop(self, keys: list[str]) -> int:
        with self.lock:
            keys_set = set(keys)
            gone = [k for k in self._stores if k[0] in keys_set]
            for k in gone:
                self._release(self._stores.pop(k))
            return len(gone)


def _assemble(st: Store, n_pos: int, layer_ids: list[int], assemble_saved: Any,
              use_shm: bool = False) -> dict[str, Any]:
    payload: dict[str, Any] = {}
    if st.error is not None:
        payload["error"] = st.error
    if st.saved:
        payload["hooks"] = assemble_saved(st.saved)
    if not st.layers:
        return payload
    mine = [l for l in st.layers if l in layer_ids]
    out_of_slot = {st.layers.index(l): i for i, l in enumerate(mine)}
    parts = [(out_of_slot[seg.slot], *seg.log.rows(seg.offset, seg.n)) for seg in st.segments
             if seg.log.blocks and seg.slot in out_of_slot]
    if not parts:
        payload.setdefault("error", "no positions were captured")
        return payload
    d, dtype = parts[0][2].shape[-1], parts[0][2].dtype
    shape = (len(mine), n_pos, d)
    mapped = shm.alloc(shape, dtype) if use_shm else None
    t = mapped[0] if mapped is not None else torch.zeros(shape, dtype=dtype)
    filled = np.zeros((len(mine), n_pos), dtype=bool)
    # one scatter for the whole request
    pos = torch.cat([p for _, p, _ in parts]).numpy()
    slot = np.concatenate([np.full(len(p), s) for s, p, _ in parts])
    rows = torch.cat([r for _, _, r in parts])
    keep = pos < n_pos
    if not keep.all():
        pos, slot, rows = pos[keep], slot[keep], rows[torch.from_numpy(keep)]
    t[torch.from_numpy(slot), torch.from_numpy(pos)] = rows
    filled[slot, pos] = True
    missing = [(l, int(np.flatnonzero(~filled[i])[0])) for i, l in enumerate(mine) if not filled[i].all()]
    if mapped is not None:
        payload.update({"layers": mine, "shm": {"path": mapped[1], "dtype": dtype_name(dtype), "shape": list(shape)}})
    else:
        payload.update({"layers": mine, "tensor": tensor_to_bytes(t)})
    if missing:
        payload.setdefault("error", f"positions never ran a forward pass (layer, first missing position): {missing}")
    return payload
