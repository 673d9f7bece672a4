"""What the result tail's kinds of host work cost on this machine, op by op, so that two hosts can be
compared where a plain Python loop cannot tell them apart: a loop, small dicts, bytes and bytearrays of a
request's block, torch tensors made from bytes and split into views (the frontend's decoding), small
reductions, and a numpy gather (the worker's assembly). One torch thread; each figure is the minimum over
`repeats` of ns per op. Also the machine: CPU model, NUMA nodes and their cores, this process's cores.

    python bench/probes/host_ops.py [repeats]   -> one JSON line
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

N_PROBES, N_POS = 8, 158  # W10's block per request: 8 probes x 158 positions x 1 output


def _machine() -> dict[str, Any]:
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    nodes = {}
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        nodes[node.name] = (node / "cpulist").read_text().strip()
    return {"cpu": model, "numa": nodes, "affinity": sorted(os.sched_getaffinity(0)), "torch_threads": 1}


def _ns(fn: Callable[[int], Any], n: int, repeats: int) -> float:
    """ns per op: the minimum over repeats of `fn(n)`'s wall over n."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn(n)
        best = min(best, time.perf_counter() - t)
    return round(best / n * 1e9, 1)


def main(repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    raw = np.random.default_rng(0).standard_normal(N_PROBES * N_POS).astype(np.float32).tobytes()
    block = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    stacked = torch.randn(256 * N_PROBES, N_POS, 1)
    src = np.random.default_rng(1).standard_normal((N_POS, 256 * N_PROBES)).astype(np.float32)
    idx = np.arange(0, 256 * N_PROBES, 7)

    def loop(n: int) -> None:
        x = 0
        for _ in range(n):
            x += 1

    def dicts(n: int) -> None:
        for i in range(n):
            {"probes": i, "scores": i, "positions": i}  # noqa: B018

    def bytearrays(n: int) -> None:
        for _ in range(n):
            bytearray(raw)

    def frombuffer(n: int) -> None:
        for _ in range(n):
            torch.frombuffer(bytearray(raw), dtype=torch.float32)

    def unbind(n: int) -> None:  # per view made
        for _ in range(n // N_PROBES):
            block.view(-1, N_POS, 1).unbind(0)

    def empty(n: int) -> None:
        for _ in range(n):
            torch.empty(1)

    def reduce_(n: int) -> None:  # per (request, probe) series, three aggregates of a stacked block
        for _ in range(max(1, n // stacked.shape[0])):
            stacked.mean(1), stacked.amax(1), stacked[:, -1]

    def gather(n: int) -> None:  # per member column: the assembly's member-major copy
        for _ in range(max(1, n // len(idx))):
            np.ascontiguousarray(src[:, idx].T)

    ops = {
        "loop": (loop, 2_000_000),
        "dict3": (dicts, 200_000),
        "bytearray_5k": (bytearrays, 50_000),
        "tensor_frombuffer_5k": (frombuffer, 50_000),
        "unbind_view": (unbind, 200_000),
        "torch_empty": (empty, 100_000),
        "aggregates_per_series": (reduce_, 2048 * 20),
        "gather_per_member": (gather, len(idx) * 200),
    }
    out: dict[str, Any] = {"machine": _machine(), "ns_per_op": {}}
    for name, (fn, n) in ops.items():
        fn(min(n, 1000))  # warm
        out["ns_per_op"][name] = _ns(fn, n, repeats)
    return out


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)))
