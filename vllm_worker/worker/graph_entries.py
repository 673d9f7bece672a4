"""The steering-entry table of the graph-safe path: `A[entry]`, `B[entry]` on the device, an entry adding
`A + B * |stream|` to a row (B: norm-matched vectors, already scaled and unit-normed; `bflag` says whether
B is used). Entries beyond addition (`op`: ablate, cap with `lo` / `hi`, set) and chains of entries applied
in order (`nxt`: the next entry, -1 none) are made by `interventions.chain_entries`. A request's entries
are written once, when it arrives, and freed when it leaves."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from vllm_worker.worker.device_copy import to_device
from vllm_worker.worker.interventions import chain_entries


class SteeringEntries:
    """The device table, its free list and the entries not yet on the device."""

    def __init__(self, n_entries: int, d: int, dtype: torch.dtype, device: torch.device) -> None:
        self.d, self.dtype, self.device = d, dtype, device
        self.A = torch.zeros((n_entries, d), dtype=dtype, device=device)
        self.B = torch.zeros((n_entries, d), dtype=dtype, device=device)
        self.bflag = torch.zeros((n_entries,), dtype=torch.int32, device=device)
        # per entry: op code (`protocol.ops`), the next entry of its chain (-1: none), cap's range
        self.op = torch.zeros((n_entries,), dtype=torch.int32, device=device)
        self.nxt = torch.full((n_entries,), -1, dtype=torch.int32, device=device)
        self.lo = torch.full((n_entries,), -math.inf, dtype=torch.float32, device=device)
        self.hi = torch.full((n_entries,), math.inf, dtype=torch.float32, device=device)
        # what an entry's add is multiplied by: 1, or a probe action's gate (0 until it fires: `actions`)
        self.gate = torch.ones((n_entries,), dtype=torch.float32, device=device)
        self._free = list(range(n_entries - 1, -1, -1))
        # entries stored since the last `flush`: index -> (A row, B row, B's flag, (op, next, lo, hi), gated) on the host
        self._new: dict[int, tuple[torch.Tensor, torch.Tensor, bool, tuple, bool]] = {}

    def add(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        ops: list[int] | None = None,
        lo: list[float] | None = None,
        hi: list[float] | None = None,
        nxt: list[int] | None = None,
        gated: bool = False,
    ) -> list[int] | None:
        """Store k entries (`a`, `b`: (k, d) float32 on the host; `ops`, `lo`, `hi` per entry, `nxt` the
        next entry of each as an index into these k, -1 none — default: additions, no chains); None when
        the table is full. They reach the device with the next `flush` (`Admission.flush`: one copy for a
        step's new requests). `gated`: their gate starts at 0 (a probe action sets it)."""
        k = a.shape[0]
        if k > len(self._free):
            return None
        idx = [self._free.pop() for _ in range(k)]
        flags = (b.abs().amax(dim=1) > 0).tolist()
        a, b = a.to(self.dtype), b.to(self.dtype)
        for i, j in enumerate(idx):  # (a later entry at the same index replaces an earlier one)
            extra = (
                0 if ops is None else ops[i],
                -1 if nxt is None or nxt[i] < 0 else idx[nxt[i]],
                -math.inf if lo is None else lo[i],
                math.inf if hi is None else hi[i],
            )
            self._new[j] = (a[i], b[i], flags[i], extra, gated)
        return idx

    def flush(self) -> None:
        """The entries stored since the last flush, to the device (before any step reads them). They leave
        the queue only once copied: a failed copy leaves them queued for the caller to fail their requests
        (`Admission.abandon`), as `admission.ToDevice` does."""
        if not self._new:
            return
        pending = self._new
        idx = to_device(torch.tensor(list(pending), dtype=torch.long), self.device)
        rows = to_device(torch.stack([r for a, b, *_ in pending.values() for r in (a, b)]), self.device)  # A, B, ...
        ints = [(f, x[0], x[1]) for _, _, f, x, _ in pending.values()]
        ints_d = to_device(torch.tensor(ints, dtype=torch.int32), self.device)  # flag, op, next
        bounds = to_device(
            torch.tensor([x[2:] for _, _, _, x, _ in pending.values()], dtype=torch.float32), self.device
        )
        gates = to_device(torch.tensor([0.0 if g else 1.0 for *_, g in pending.values()]), self.device)
        self.A.index_copy_(0, idx, rows[0::2])
        self.B.index_copy_(0, idx, rows[1::2])
        self.bflag.index_copy_(0, idx, ints_d[:, 0].contiguous())
        self.op.index_copy_(0, idx, ints_d[:, 1].contiguous())
        self.nxt.index_copy_(0, idx, ints_d[:, 2].contiguous())
        self.lo.index_copy_(0, idx, bounds[:, 0].contiguous())
        self.hi.index_copy_(0, idx, bounds[:, 1].contiguous())
        self.gate.index_copy_(0, idx, gates)
        self._new = {}

    def in_use(self) -> int:
        """Entries held by live requests (`lens_status`)."""
        return self.A.shape[0] - len(self._free)

    def free(self, idx: list[int]) -> None:
        self._free.extend(idx)

    def clear(self) -> None:
        """Drop the queued entries (their requests failed: `Admission.abandon`)."""
        self._new = {}


def entries_for(
    table: SteeringEntries, sites: dict[int, int], steers: list[Any], gated: bool = False
) -> tuple[dict, list[int]] | None:
    """A request's steering (`plan.DeviceSteer`s) as entries of `table`: per site this stage holds (`sites`:
    site -> column), one default entry (its position-independent vectors) and one per position its 3-D
    vectors name (the default plus those). None when the table is full (the request then takes the Python
    path). Steering beyond plain addition: `interventions.chain_entries`."""
    if not all(st.plain for st in steers):
        if gated:  # (validation keeps a probe action's steering to plain additions)
            raise ValueError("a probe action's steering is a plain addition")
        return chain_entries(table, sites, steers)
    rows_a: list[torch.Tensor] = []
    rows_b: list[torch.Tensor] = []
    layout: list[tuple[int, bool, list[int]]] = []
    zero = torch.zeros(table.d, dtype=torch.float32)  # (on the host: `add` takes host rows)
    for layer in sorted({l for st in steers for l in st.layers if l in sites}):  # `layer`: a site
        da, db, has_default = zero.clone(), zero.clone(), False
        pa: dict[int, torch.Tensor] = {}
        pb: dict[int, torch.Tensor] = {}
        for st in steers:
            row = st.layers.get(layer)
            if row is None:
                continue
            v = st.vectors[row].float()
            if st.norm_match:
                v = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            v = v * st.scale
            if st.positions is None:
                if st.norm_match:
                    db += v
                else:
                    da += v
                has_default = True
            else:
                mine = {p: k for k, p in enumerate(st.positions)}  # a repeated position: the last row wins
                target = pb if st.norm_match else pa
                for p, k in mine.items():
                    target[p] = v[k] if p not in target else target[p] + v[k]
        positions = sorted(set(pa) | set(pb))
        layout.append((layer, has_default, positions))
        if has_default:
            rows_a.append(da)
            rows_b.append(db)
        for p in positions:
            rows_a.append(da + pa[p] if p in pa else da)
            rows_b.append(db + pb[p] if p in pb else db)
    if not rows_a:
        return {}, []
    ids = table.add(torch.stack(rows_a), torch.stack(rows_b), gated=gated)
    if ids is None:
        return None
    out: dict[int, tuple[int, np.ndarray, np.ndarray, int, int]] = {}
    k = 0
    for layer, has_default, positions in layout:
        default = -1
        if has_default:
            default, k = ids[k], k + 1
        ents = np.array(ids[k : k + len(positions)], dtype=np.int32)
        k += len(positions)
        out[layer] = (default, np.array(positions, dtype=np.int64), ents, -1, -1)  # (no phase: `interventions`)
    return out, ids
