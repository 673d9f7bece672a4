"""Can the GPU write captured rows straight into the result pool? (H200 probe, no vLLM needed.)

Why: W2's host copies (step arena -> pool region, `transport/early.py`) share the host with vLLM's own step
loop, which is what W2's wall waits for. If the pool's /dev/shm segments can be registered with CUDA
(`cudaHostRegister`) and written by a kernel (zero-copy over the host link), no host copy is left. This
measures, on a 4 GiB pool-like segment: registration time, the bandwidth of a row-scatter kernel into it
(decode-sized and prefill-sized steps, in and out of a CUDA graph), the DMA bandwidth of a plain copy for
reference, and how much such a kernel on a side stream slows matmuls on the main stream.

Run: python bench/probes/gpu_direct_probe.py  (prints one JSON line per measurement)
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import time

import torch
import triton
import triton.language as tl


@triton.jit
def scatter(src_ptr, dst_ptr, off_ptr, d, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < d
    v = tl.load(src_ptr + i.to(tl.int64) * d + offs, mask=m)
    o = tl.load(off_ptr + i)
    tl.store(dst_ptr + o * d + offs, v, mask=m)


@triton.jit
def scatter_loop(src_ptr, dst_ptr, off_ptr, n, d, BLOCK: tl.constexpr):
    """The same with a few programs, each every num_programs-th row (what the plugin launches)."""
    offs = tl.arange(0, BLOCK)
    m = offs < d
    for i in range(tl.program_id(0), n, tl.num_programs(0)):
        v = tl.load(src_ptr + i.to(tl.int64) * d + offs, mask=m)
        o = tl.load(off_ptr + i)
        tl.store(dst_ptr + o * d + offs, v, mask=m)


class HostView:
    """What a Triton launch needs of an argument: an address and a dtype."""

    def __init__(self, ptr: int, dtype: torch.dtype) -> None:
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


def out(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def main() -> None:
    size = 4 << 30
    path = f"/dev/shm/lens-direct-probe-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, size)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    os.close(fd)
    os.unlink(path)
    host = torch.frombuffer(mm, dtype=torch.bfloat16)
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    cudart = torch.cuda.cudart()
    torch.cuda.init()
    t0 = time.perf_counter()
    rc = cudart.cudaHostRegister(ptr, size, 0)
    out(what="register", rc=int(rc), seconds=time.perf_counter() - t0, gib=size / 2**30)
    out(what="is_pinned", value=bool(host.is_pinned()))
    dev = torch.device("cuda")
    d = 4096
    rows_total = size // (2 * d)
    view = HostView(ptr, torch.bfloat16)
    for name, n in (("decode-step W2 (256 x 32 rows)", 256 * 32), ("prefill W2 (7680 x 32 rows)", 7680 * 32)):
        src = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
        # scattered destinations: as a batch's regions lay out (layer-major per request, rows apart)
        offs = torch.randperm(rows_total, device=dev)[:n].to(torch.int64)
        scatter[(n,)](src, view, offs, d, BLOCK=d)
        torch.cuda.synchronize()
        reps = 5 if n > 10000 else 50
        t0 = time.perf_counter()
        for _ in range(reps):
            scatter[(n,)](src, view, offs, d, BLOCK=d)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / reps
        ok = bool(torch.equal(host.view(rows_total, d)[offs[:64].cpu()], src[:64].cpu()))
        out(what="scatter", case=name, ms=dt * 1e3, gbps=n * d * 2 / dt / 1e9, correct=ok)
        for progs in (16, 64, 132):
            scatter_loop[(progs,)](src, view, offs, n, d, BLOCK=d)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                scatter_loop[(progs,)](src, view, offs, n, d, BLOCK=d)
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / reps
            out(what="scatter-loop", programs=progs, case=name, ms=dt * 1e3, gbps=n * d * 2 / dt / 1e9)
        # the same into device memory, and a contiguous DMA copy to pinned memory, for reference
        dst_dev = torch.empty(n + 8, d, device=dev, dtype=torch.bfloat16)
        offd = torch.randperm(n, device=dev).to(torch.int64)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            scatter[(n,)](src, dst_dev, offd, d, BLOCK=d)
        torch.cuda.synchronize()
        out(what="scatter-device", case=name, ms=(time.perf_counter() - t0) / reps * 1e3)
        pin = torch.empty(n, d, dtype=torch.bfloat16, pin_memory=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            pin.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / reps
        out(what="dma-copy", case=name, ms=dt * 1e3, gbps=n * d * 2 / dt / 1e9)
        # in a CUDA graph
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            scatter[(n,)](src, view, offs, d, BLOCK=d)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            scatter[(n,)](src, view, offs, d, BLOCK=d)
        src.add_(1)
        g.replay()
        torch.cuda.synchronize()
        ok = bool(torch.equal(host.view(rows_total, d)[offs[:64].cpu()], src[:64].cpu()))
        out(what="scatter-in-graph", case=name, correct=ok)
        del src, dst_dev, pin

    # interference: matmuls on the main stream with and without the scatter on a side stream
    a = torch.randn(256, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 14336, device=dev, dtype=torch.bfloat16)
    n = 256 * 32
    src = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
    offs = torch.randperm(rows_total, device=dev)[:n].to(torch.int64)
    side = torch.cuda.Stream()

    def mm_loop(k: int) -> None:
        for _ in range(k):
            torch.matmul(a, w)

    mm_loop(20)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    mm_loop(2000)
    torch.cuda.synchronize()
    base = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(2000):
        if i % 250 == 0:  # one decode step's rows per ~10 ms of matmul, as in W2
            with torch.cuda.stream(side):
                scatter[(n,)](src, view, offs, d, BLOCK=d)
        torch.matmul(a, w)
    torch.cuda.synchronize()
    both = time.perf_counter() - t0
    out(what="interference", matmul_s=base, with_side_scatter_s=both, scatters=8)
    for progs in (16, 64):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(2000):
            if i % 250 == 0:
                with torch.cuda.stream(side):
                    scatter_loop[(progs,)](src, view, offs, n, d, BLOCK=d)
            torch.matmul(a, w)
        torch.cuda.synchronize()
        out(what="interference-loop", programs=progs, matmul_s=base, with_side_scatter_s=time.perf_counter() - t0)
    t0 = time.perf_counter()
    rc = cudart.cudaHostUnregister(ptr)
    out(what="unregister", rc=int(rc), seconds=time.perf_counter() - t0)
    launch_gaps_while_registering(cudart, mm, ptr, size)


def launch_gaps_while_registering(cudart: object, mm: mmap.mmap, ptr: int, size: int) -> None:
    """Does registering a segment (a background thread, as the pool grows) stall the step thread's launches?"""
    import threading

    x = torch.zeros(1024, device="cuda")
    done = threading.Event()
    took: list[float] = []

    def reg() -> None:
        t = time.perf_counter()
        cudart.cudaHostRegister(ptr, size, 0)  # type: ignore[attr-defined]
        took.append(time.perf_counter() - t)
        done.set()

    gaps = []
    for _ in range(200):
        x.add_(1)
    torch.cuda.synchronize()
    th = threading.Thread(target=reg)
    last = time.perf_counter()
    th.start()
    n = 0
    while not done.is_set() or n < 1000:
        x.add_(1)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        n += 1
        if n % 64 == 0:
            torch.cuda.synchronize()
    th.join()
    gaps.sort()
    out(
        what="launch-gaps-while-registering",
        register_s=took[0],
        launches=len(gaps),
        max_ms=gaps[-1] * 1e3,
        p99_ms=gaps[int(len(gaps) * 0.99)] * 1e3,
        median_us=gaps[len(gaps) // 2] * 1e6,
    )
    cudart.cudaHostUnregister(ptr)  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
