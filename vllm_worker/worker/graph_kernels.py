"""The Triton kernels of the graph-safe path (`graph`): the tap kernel (capture and steering of one site,
one program per row, reading the control table) and the scatter kernel (staging rows written straight
into the result pool's host memory), with what the scatter does on a CPU engine."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

# programs of the direct-write kernel (`transport.early`): the host link bounds it, so a few programs keep
# it busy without taking the SMs from the forward (figures: docs/decisions.md, "direct writes")
SCATTER_PROGRAMS = 64


def make_tap_kernel() -> Any:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def tap_kernel(
        h_ptr,
        r_ptr,
        ctl_ptr,
        base_ptr,
        stage_ptr,
        a_ptr,
        b_ptr,
        bflag_ptr,
        gate_ptr,
        op_ptr,
        nxt_ptr,
        lo_ptr,
        hi_ptr,
        col,
        max_rows,
        d,
        w,
        stride_h,
        stride_r,
        HAS_R: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0)
        # piece j of a row wider than d (mlp_post): values [j*d, j*d + d) are site column col + j, so one
        # launch serves every piece of the tap (a launch per piece cost every step, idle ones too); 0 elsewhere
        j = tl.program_id(1)
        c = ((col + j) * max_rows + i) * 2
        slot = tl.load(ctl_ptr + c)
        ent = tl.load(ctl_ptr + c + 1)
        if (slot >= 0) | (ent >= 0):
            offs = tl.arange(0, BLOCK)
            # the piece's width: d, fewer values (router logits, an mlp_post row's last piece) in a d-wide row
            m = offs < tl.minimum(w - j * d, d)
            hp = h_ptr + i.to(tl.int64) * stride_h + j * d + offs
            h = tl.load(hp, mask=m, other=0.0)
            if HAS_R:  # (single-piece sites only: j is 0)
                r = tl.load(r_ptr + i.to(tl.int64) * stride_r + offs, mask=m, other=0.0).to(tl.float32)
            else:
                r = tl.zeros([BLOCK], dtype=tl.float32)
            if ent >= 0:
                # the entry's chain, in order (`interventions`): float32 throughout, rounded once
                x = h.to(tl.float32)
                while ent >= 0:
                    e = ent.to(tl.int64) * d
                    a = tl.load(a_ptr + e + offs, mask=m, other=0.0).to(tl.float32)
                    op = tl.load(op_ptr + ent)
                    if op == 0:  # add: A + B * |stream|
                        if tl.load(bflag_ptr + ent) != 0:
                            s = x + r
                            nrm = tl.sqrt(tl.sum(s * s, axis=0))
                            a += tl.load(b_ptr + e + offs, mask=m, other=0.0).to(tl.float32) * nrm
                        x = x + a * tl.load(gate_ptr + ent)  # 1, or a probe action's gate (0 until fired)
                    elif op == 3:  # set: A + B * stream (B: 1 where kept)
                        keep = tl.load(b_ptr + e + offs, mask=m, other=0.0).to(tl.float32)
                        x = a + keep * (x + r) - r
                    else:  # ablate (1) / cap (2): the projection on the unit direction A moved
                        s = x + r
                        p = tl.sum(s * a, axis=0)
                        q = p * 0.0
                        if op == 2:
                            q = tl.minimum(tl.maximum(p, tl.load(lo_ptr + ent)), tl.load(hi_ptr + ent))
                        x = x + (q - p) * a
                    ent = tl.load(nxt_ptr + ent)
                h = x.to(h.dtype)
                tl.store(hp, h, mask=m)
            if slot >= 0:
                out = (h.to(tl.float32) + r).to(stage_ptr.dtype.element_ty)
                at = slot.to(tl.int64) + tl.load(base_ptr).to(tl.int64)
                tl.store(stage_ptr + at * d + offs, out, mask=m)

    return tap_kernel


def make_scatter_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["first", "n"])
    def scatter_kernel(stage_ptr, dst_ptr, off_ptr, first, n, d, BLOCK: tl.constexpr):
        """Staging rows `first + i` (i < n) to element `off[i]` from `dst_ptr` (host memory the GPU can
        write; -1: not written), each program every `num_programs`-th row: the writes are bound by the
        host link, and a few programs keep it busy without taking the SMs from the forward."""
        offs = tl.arange(0, BLOCK)
        m = offs < d
        for i in range(tl.program_id(0), n, tl.num_programs(0)):
            o = tl.load(off_ptr + i)
            if o >= 0:
                v = tl.load(stage_ptr + (first + i).to(tl.int64) * d + offs, mask=m)
                tl.store(dst_ptr + o + offs, v, mask=m)

    return scatter_kernel


class Address:
    """An address as a kernel argument (Triton asks an argument for `data_ptr()` and `dtype`): the start of
    registered host memory, which has no tensor of its own."""

    __slots__ = ("ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype) -> None:
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


def host_scatter(src: np.ndarray, origin: int, span: int, offs: np.ndarray) -> None:
    """What the scatter kernel does, on the host (CPU engines): the same offsets, the same memory."""
    flat = np.frombuffer(memoryview((ctypes.c_byte * span).from_address(origin)), dtype=src.dtype)
    keep = offs >= 0
    flat[offs[keep][:, None] + np.arange(src.shape[1])] = src[keep]
