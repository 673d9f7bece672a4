"""The control table of the graph-safe path: `ctl[col, row] = (slot, entry)` on the device, filled from a
double-buffered host copy before each step (`graph` says what the two numbers mean).

Column-major, so a step resets and uploads only the columns it or the step before used; slots are relative
to `base` (one device scalar), so a decode step of an unchanged batch finds its table already on the
device (`holds`) and only `base` moves."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_worker.worker.device_copy import to_device

COL_INDEXES_KEPT = 256  # device index tensors of column sets remembered (then the memo starts over)


class ControlTable:
    """The device table, its host copies and what the last upload left in it."""

    def __init__(self, n_cols: int, max_rows: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.n_cols, self.max_rows, self.device = n_cols, max_rows, device
        self.ctl = torch.full((n_cols, max_rows, 2), -1, dtype=torch.int32, device=device)
        self.base = torch.zeros(1, dtype=torch.int32, device=device)  # the running step's first ring row
        self._base = 0  # ... as last set from the host
        # double-buffered host copies of ctl (pinned on CUDA: the upload is asynchronous)
        self._host = [torch.full((n_cols, max_rows, 2), -1, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        self._host_ev: list[Any] = [None, None]
        # a step using several columns uploads them as one block (gathered from the host table, one copy,
        # one scatter into `ctl` on the device) instead of one copy per column
        self._blk = [torch.empty(n_cols * max_rows * 2, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        self._blk_dev = torch.empty(n_cols * max_rows * 2, dtype=torch.int32, device=device)
        self._col_index: dict[tuple[int, ...], torch.Tensor] = {}
        self._turn = 0
        self.dirty = 0  # rows of ctl that may hold something other than -1 ...
        self.dirty_cols: frozenset = frozenset()  # ... in these columns
        self.fill_cols: list[int] = []  # columns the step being prepared resets and uploads ...
        self.fill_rows = 0  # ... in rows [0, fill_rows)
        self.holds: Any = None  # the plan (`plan.GraphPlan`) whose table `ctl` holds now, if any

    def host(self, n: int, live_cols: frozenset) -> np.ndarray:
        """The host table for this step (`[col, row]`): in the columns the step uses (`live_cols`) and those
        the last step left dirty, rows [0, max(n, dirty)) reset to -1; `upload` sends those columns."""
        k = self._turn
        ev = self._host_ev[k]
        if ev is not None:
            ev.synchronize()
        m = max(n, self.dirty)
        h = self._host[k].numpy()
        self.fill_cols = sorted(live_cols | self.dirty_cols)
        if self.fill_cols:
            h[self.fill_cols, :m] = -1
        self.fill_rows = m
        return h

    def upload(self, n: int, live_cols: frozenset, owner: Any) -> None:
        """Send the table `host` handed out; `owner`: the plan it is the table of (`holds`)."""
        k = self._turn
        m = self.fill_rows
        cols = self.fill_cols
        if len(cols) > 1 and m:
            c = len(cols)
            blk = self._blk[k][: c * m * 2].view(c, m, 2)
            blk.numpy()[...] = self._host[k].numpy()[cols, :m]
            dev = self._blk_dev[: c * m * 2].view(c, m, 2)
            dev.copy_(blk, non_blocking=True)
            self.ctl[:, :m].index_copy_(0, self._cols_index(cols), dev)
        else:
            for c in cols:
                self.ctl[c, :m].copy_(self._host[k][c, :m], non_blocking=True)
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._host_ev[k] = ev
        self._turn = 1 - k
        self.dirty = n
        self.dirty_cols = live_cols
        self.holds = owner

    def set_base(self, base: int) -> None:
        """The step's first staging row (a scalar written on the device's stream, in order with the steps)."""
        if base != self._base:
            self.base.fill_(base)
            self._base = base

    def _cols_index(self, cols: list[int]) -> torch.Tensor:
        """The columns as a device index (made once per set of columns: steps of a plan share it)."""
        key = tuple(cols)
        got = self._col_index.get(key)
        if got is None:
            if len(self._col_index) >= COL_INDEXES_KEPT:
                self._col_index.clear()
            got = self._col_index[key] = to_device(torch.tensor(cols, dtype=torch.long), self.device)
        return got

    def clear(self) -> None:
        """No row may still point anywhere (before a step that does not use the path)."""
        if self.dirty:
            for c in self.dirty_cols:
                self.ctl[c, : self.dirty].fill_(-1)
            self.dirty = 0
            self.dirty_cols = frozenset()
        self.holds = None
