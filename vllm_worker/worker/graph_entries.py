"""The steering-entry table of the graph-safe path: `A[entry]`, `B[entry]` on the device, an entry adding
`A + B * |stream|` to a row (B: norm-matched vectors, already scaled and unit-normed; `bflag` says whether
B is used). A request's entries are written once, when it arrives, and freed when it leaves."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_worker.worker.device_copy import to_device


class SteeringEntries:
    """The device table, its free list and the entries not yet on the device."""

    def __init__(self, n_entries: int, d: int, dtype: torch.dtype, device: torch.device) -> None:
        self.d, self.dtype, self.device = d, dtype, device
        self.A = torch.zeros((n_entries, d), dtype=dtype, device=device)
        self.B = torch.zeros((n_entries, d), dtype=dtype, device=device)
        self.bflag = torch.zeros((n_entries,), dtype=torch.int32, device=device)
        # what an entry's add is multiplied by: 1, or a probe action's gate (0 until it fires: `actions`)
        self.gate = torch.ones((n_entries,), dtype=torch.float32, device=device)
        self._free = list(range(n_entries - 1, -1, -1))
        # entries stored since the last `flush`: index -> (A row, B row, B's flag, gated) on the host
        self._new: dict[int, tuple[torch.Tensor, torch.Tensor, bool, bool]] = {}

    def add(self, a: torch.Tensor, b: torch.Tensor, gated: bool = False) -> list[int] | None:
        """Store k entries (`a`, `b`: (k, d) float32 on the host); None when the table is full. They reach
        the device with the next `flush` (`Admission.flush`: one copy for a step's new requests). `gated`:
        their gate starts at 0 (a probe action sets it)."""
        k = a.shape[0]
        if k > len(self._free):
            return None
        idx = [self._free.pop() for _ in range(k)]
        flags = (b.abs().amax(dim=1) > 0).tolist()
        a, b = a.to(self.dtype), b.to(self.dtype)
        for i, j in enumerate(idx):  # (a later entry at the same index replaces an earlier one)
            self._new[j] = (a[i], b[i], flags[i], gated)
        return idx

    def flush(self) -> None:
        """The entries stored since the last flush, to the device (before any step reads them). They leave
        the queue only once copied: a failed copy leaves them queued for the caller to fail their requests
        (`Admission.abandon`), as `admission.ToDevice` does."""
        if not self._new:
            return
        pending = self._new
        idx = to_device(torch.tensor(list(pending), dtype=torch.long), self.device)
        rows = to_device(torch.stack([r for a, b, _, _ in pending.values() for r in (a, b)]), self.device)  # A, B, ...
        flags = to_device(torch.tensor([f for _, _, f, _ in pending.values()], dtype=torch.int32), self.device)
        gates = to_device(torch.tensor([0.0 if g else 1.0 for *_, g in pending.values()]), self.device)
        self.A.index_copy_(0, idx, rows[0::2])
        self.B.index_copy_(0, idx, rows[1::2])
        self.bflag.index_copy_(0, idx, flags)
        self.gate.index_copy_(0, idx, gates)
        self._new = {}

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
    path)."""
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
    ids = table.add(torch.stack(rows_a), torch.stack(rows_b), gated)
    if ids is None:
        return None
    out: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}
    k = 0
    for layer, has_default, positions in layout:
        default = -1
        if has_default:
            default, k = ids[k], k + 1
        ents = np.array(ids[k : k + len(positions)], dtype=np.int32)
        k += len(positions)
        out[layer] = (default, np.array(positions, dtype=np.int64), ents)
    return out, ids
