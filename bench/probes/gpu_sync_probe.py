"""Which small per-step operations of the worker wait for the device (H200, torch only, no vLLM): each is
timed on the host right after ~50 ms of matmuls were queued — an operation that waits shows ~50 ms, an
asynchronous one microseconds. Prints one JSON line per operation.

    python bench/probes/gpu_sync_probe.py
"""

from __future__ import annotations

import json
import time

import torch


def main() -> None:
    dev = torch.device("cuda")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    stage = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(1, 4096, device=dev)
    w2 = torch.randn(2, 4096, device=dev)
    slots = torch.arange(256, device=dev)
    rec1 = torch.empty(64, 256, 1, device=dev)
    rec2 = torch.empty(64, 256, 2, device=dev)
    table = torch.zeros(512, 4, dtype=torch.long, device=dev)
    buf32 = torch.empty(256, 4096, device=dev)

    def busy() -> None:
        for _ in range(40):
            a @ a  # ~1 ms each on an H200

    def mm_out_n1() -> None:
        x = stage.index_select(0, slots)
        torch.mm(x.to(torch.float32), w1.T, out=rec1[3])

    def mm_out_n2() -> None:
        x = stage.index_select(0, slots)
        torch.mm(x.to(torch.float32), w2.T, out=rec2[3])

    def mm_copy_n1() -> None:
        x = stage.index_select(0, slots)
        rec1[3].copy_(x.to(torch.float32) @ w1.T)

    def mm_buf_n1() -> None:
        buf32.copy_(stage.index_select(0, slots))
        torch.mm(buf32, w1.T, out=rec1[3])

    def vecdot_n1() -> None:
        x = stage.index_select(0, slots)
        rec1[3, :, 0].copy_(torch.linalg.vecdot(x.float(), w1))

    def tensor_list() -> None:
        torch.tensor(list(range(256)), dtype=torch.long, device=dev)

    def tensor_pinned() -> None:
        torch.tensor(list(range(256)), dtype=torch.long).pin_memory().to(dev, non_blocking=True)

    def setitem_cpu_row() -> None:
        table[7] = torch.tensor([1, 2, 3, 4], dtype=torch.long)

    def setitem_scalar() -> None:
        table[7, 0] = 5

    ops = [mm_out_n1, mm_out_n2, mm_copy_n1, mm_buf_n1, vecdot_n1, tensor_list, tensor_pinned, setitem_cpu_row]
    ops.append(setitem_scalar)
    for op in ops:
        op()
    torch.cuda.synchronize()
    for op in ops:
        times = []
        for _ in range(5):
            busy()
            t = time.perf_counter()
            op()
            times.append((time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize()
        t = time.perf_counter()
        busy()
        queue_ms = (time.perf_counter() - t) * 1e3
        torch.cuda.synchronize()
        g = time.perf_counter()
        busy()
        torch.cuda.synchronize()
        gpu_ms = (time.perf_counter() - g) * 1e3
        print(json.dumps({"op": op.__name__, "host_ms": sorted(times)[2], "queue_ms": queue_ms, "busy_gpu_ms": gpu_ms}))


if __name__ == "__main__":
    main()
