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
from .wire import tensor_to_bytes

logger = logging.getLogger("vllm_worker")

# Captures kept in the worker until fetched. Past the cap the oldest are dropped and a later fetch of
# them reports it (an error, never a silent empty result).
MAX_STORED_BYTES = int(float(os.environ.get("VLLM_LENS_MAX_STORED_GB", "8")) * (1 << 30))


@dataclass
class Store:
    """Everything a request hands back: captures, hook state, and the first failure."""

    layers: list[int]
    # (slot in `layers`, absolute positions (host int64), rows (host; pinned while a copy may be in flight))
    chunks: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    nbytes: int = 0
    saved: list[dict] = field(default_factory=list)
    error: str | None = None


class CaptureStore:
    def __init__(self, device: torch.device) -> None:
        self._stores: dict[tuple[str, int], Store] = {}
        self._evicted: set[str] = set()
        self.stored_bytes = 0
        self.lock = threading.Lock()
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __len__(self) -> int:
        return len(self._stores)

    def add(self, key: str, child: int, store: Store) -> None:
        with self.lock:
            self._stores[(key, child)] = store

    # ------------------------------------------------------------ per step

    def _to_host(self, dev: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._side is None:
            return dev.to("cpu"), pos.to("cpu")
        side = self._side
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
        """File this step's captured rows under their requests (one device->host copy per step)."""
        layers = [l for l, _ in plan.captured]
        sizes = [t.shape[0] for _, t in plan.captured]
        dev = torch.cat([t for _, t in plan.captured])
        all_idx = torch.cat([plan.capture[l][0] for l in layers])
        host, pos_host = self._to_host(dev, plan.positions.index_select(0, all_idx))
        off = 0
        with self.lock:
            for layer, size in zip(layers, sizes):
                block = host[off:off + size]
                pblock = pos_host[off:off + size]
                o = 0
                for r, s, e in plan.capture[layer][1]:
                    n = e - s
                    st = r.store
                    view = block[o:o + n]
                    st.chunks.append((r.capture_slot[layer], pblock[o:o + n], view))
                    nb = view.numel() * view.element_size()
                    st.nbytes += nb
                    self.stored_bytes += nb
                    o += n
                off += size
            self._evict_if_needed()

    def _evict_if_needed(self) -> None:
        while self.stored_bytes > MAX_STORED_BYTES and self._stores:
            key = next(iter(self._stores))
            st = self._stores.pop(key)
            self.stored_bytes -= st.nbytes
            self._evicted.add(key[0])
            logger.error("inspect-lens: capture store over VLLM_LENS_MAX_STORED_GB; dropped request %s", key[0])

    # ------------------------------------------------------------ fetch

    def fetch(self, wanted: list[tuple[str, dict[int, int]]], reporting: bool,
              layer_ids: list[int], assemble_saved: Any) -> dict[str, Any]:
        """{key: {child: payload}} for this rank's layers; pops what it returns. A rank that does not
        report (TP rank > 0: hooks ran there too, on the same replicated stream) only drops."""
        out: dict[str, Any] = {}
        if self._side is not None:
            self._side.synchronize()
        with self.lock:
            if not reporting:
                for key, children in wanted:
                    for child in children:
                        st = self._stores.pop((key, int(child)), None)
                        if st is not None:
                            self.stored_bytes -= st.nbytes
                return out
            for key, children in wanted:
                if key in self._evicted:
                    self._evicted.discard(key)
                    out[key] = {"error": "captures were dropped: the worker's store exceeded "
                                         "VLLM_LENS_MAX_STORED_GB before they were fetched"}
                    continue
                per_child = {}
                for child, n_pos in children.items():
                    st = self._stores.pop((key, int(child)), None)
                    if st is None:
                        continue
                    self.stored_bytes -= st.nbytes
                    per_child[int(child)] = _assemble(st, int(n_pos), layer_ids, assemble_saved)
                if per_child:
                    out[key] = per_child
        return out

    def drop(self, keys: list[str]) -> int:
        with self.lock:
            keys_set = set(keys)
            gone = [k for k in self._stores if k[0] in keys_set]
            for k in gone:
                self.stored_bytes -= self._stores.pop(k).nbytes
            return len(gone)


def _assemble(st: Store, n_pos: int, layer_ids: list[int], assemble_saved: Any) -> dict[str, Any]:
    payload: dict[str, Any] = {}
    if st.error is not None:
        payload["error"] = st.error
    if st.saved:
        payload["hooks"] = assemble_saved(st.saved)
    if not st.layers:
        return payload
    mine = [l for l in st.layers if l in layer_ids]
    slots = [st.layers.index(l) for l in mine]
    if not st.chunks:
        payload.setdefault("error", "no positions were captured")
        return payload
    d = st.chunks[0][2].shape[-1]
    t = torch.zeros((len(st.layers), n_pos, d), dtype=st.chunks[0][2].dtype)
    filled = np.zeros((len(st.layers), n_pos), dtype=bool)
    # one scatter for the whole request (a few hundred chunks: one per step and layer)
    pos = torch.cat([c[1] for c in st.chunks]).numpy()
    slot = np.concatenate([np.full(len(c[1]), c[0]) for c in st.chunks])
    rows = torch.cat([c[2] for c in st.chunks])
    keep = pos < n_pos
    if not keep.all():
        pos, slot, rows = pos[keep], slot[keep], rows[torch.from_numpy(keep)]
    t[torch.from_numpy(slot), torch.from_numpy(pos)] = rows
    filled[slot, pos] = True
    t = t[slots]
    missing = [(l, int(np.flatnonzero(~filled[s])[0])) for l, s in zip(mine, slots) if not filled[s].all()]
    payload.update({"layers": mine, "tensor": tensor_to_bytes(t)})
    if missing:
        payload.setdefault("error", f"positions never ran a forward pass (layer, first missing position): {missing}")
    return payload
