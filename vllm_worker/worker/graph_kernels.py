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
    """The tap kernel (`tap_kernel`), or None where Triton is not importable."""
    try:
        from vllm_worker.worker.tap_kernel import tap_kernel
    except ImportError:
        return None
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
