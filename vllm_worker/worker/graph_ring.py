"""The staging ring of the graph-safe path: the device rows the tap kernel writes a step's captured streams
to, copied to pinned host memory on a side stream after the step (no synchronisation in the step), and in
direct mode (`transport.early`) written straight into the result pool's host memory by the scatter kernel."""

from __future__ import annotations

import collections
import logging
from typing import Any

import numpy as np
import torch

from vllm_worker.transport.result_pool import host_array
from vllm_worker.worker.graph_kernels import SCATTER_PROGRAMS, Address, host_scatter, make_scatter_kernel

logger = logging.getLogger("vllm_worker")


class StagingRing:
    """`stage` rows handed out per step (`alloc`) and copied out (`copy_out`); a row is reused once the copy
    that read it is done."""

    def __init__(
        self,
        rows: int,
        d: int,
        dtype: torch.dtype,
        device: torch.device,
        side: "torch.cuda.Stream | None",
        block: int,
        direct: bool,
    ) -> None:
        self.rows, self.d, self.dtype, self.device = rows, d, dtype, device
        self.stage = torch.empty((rows, d), dtype=dtype, device=device)
        self._side = side
        self._block = block
        self._pos = 0
        self._pending: collections.deque = collections.deque()  # (start, end, event) copies in flight
        # direct mode: per step, the rows' offsets into the result pool (pinned, two turns: a step's offsets
        # are not overwritten before their upload ran) and their device copy
        self._scatter: Any = None
        self._offs_host: list[torch.Tensor] = []
        self._offs_ev: list[Any] = [None, None]
        self._offs_dev: torch.Tensor | None = None
        self._offs_turn = 0
        self.direct_ok = False  # the direct-write kernel is ready (CUDA, `VLLM_LENS_DIRECT_POOL`)
        if direct and device.type == "cuda":
            self._start_direct()

    def _start_direct(self) -> None:
        """Compile the scatter kernel now (not in a step) and check that its write to host memory lands."""
        try:
            self._scatter = make_scatter_kernel()
            self._offs_host = [torch.empty(self.rows, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self._offs_dev = torch.full((self.rows,), -1, dtype=torch.int64, device=self.device)
            probe = torch.zeros(self.d, dtype=self.dtype, pin_memory=True)
            self.stage[0].normal_()
            self._offs_dev[0] = 0
            self._scatter[(1,)](
                self.stage, Address(probe.data_ptr(), self.dtype), self._offs_dev, 0, 1, self.d, BLOCK=self._block
            )
            torch.cuda.synchronize(self.device)
            if not torch.equal(probe, self.stage[0].cpu()):
                raise RuntimeError("the kernel's write to host memory did not land")
            self.direct_ok = True
        except Exception as e:  # noqa: BLE001 - captures are copied on the host instead
            logger.error("inspect-lens: direct writes into the result pool are off (%s: %s)", type(e).__name__, e)

    def alloc(self, n: int, copied: bool = True) -> int | None:
        """First slot of `n` consecutive staging rows for this step (waits for old copies of them). `copied`
        False: the step copies none of them out (probe scores, SAE features, action rows: read on the device
        in the stream's order, before the next step's kernels), so the next step may take the same rows —
        the ring stays where it is, and so does the step's base (`ControlTable.set_base` writes nothing)."""
        if n > self.rows:
            return None
        base = self._pos if self._pos + n <= self.rows else 0
        end = base + n
        for item in list(self._pending):
            s, e, ev = item
            if ev is None or ev.query():
                self._pending.remove(item)
            elif s < end and base < e:
                ev.synchronize()
                self._pending.remove(item)
        if copied:
            self._pos = end
        return base

    def copy_out(self, base: int, n: int, dst: torch.Tensor | None, direct: tuple | None = None) -> None:
        """The step's captured rows into `dst` (pinned host memory on CUDA: asynchronously, on the side
        stream after the step's kernels; their staging rows are reused once the copy is done). `direct`:
        (origin, span, offsets, _) from `EarlyAssembler.direct_rows`: the rows are (also, or with `dst`
        None only) written there, by the GPU."""
        src = self.stage[base : base + n]
        if self._side is None:
            if dst is not None:
                dst.copy_(src)
            if direct is not None:
                host_scatter(host_array(src), direct[0], direct[1], direct[2])
            return
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        if direct is not None:
            offs = self._offsets(direct[2])
        with torch.cuda.stream(side):
            if direct is not None:
                dev = self._offs_dev
                assert dev is not None  # made by `_offsets`
                dev[:n].copy_(offs, non_blocking=True)
                self._offs_ev[self._offs_turn] = torch.cuda.Event()
                self._offs_ev[self._offs_turn].record(side)
                self._offs_turn ^= 1
                self._scatter[(min(n, SCATTER_PROGRAMS),)](
                    self.stage, Address(direct[0], self.dtype), dev, base, n, self.d, BLOCK=self._block
                )
            if dst is not None:
                dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(side)
        self._pending.append((base, base + n, ev))

    def _offsets(self, offs: np.ndarray) -> torch.Tensor:
        """`offs` in this turn's pinned buffer (waiting for the upload that last used it)."""
        n = len(offs)
        if self._scatter is None or n > self.rows:
            raise RuntimeError("direct writes were not set up (VLLM_LENS_DIRECT_POOL at start-up)")
        k = self._offs_turn
        ev = self._offs_ev[k]
        if ev is not None:
            ev.synchronize()
        h = self._offs_host[k][:n]
        h.numpy()[:] = offs
        return h
