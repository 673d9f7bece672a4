"""Device time of each forward pass, for benchmarks (`VLLM_LENS_GPU_CLOCK`): the host clock alone cannot tell a
step that is slower on the device (our kernels) from one whose host work keeps the device waiting."""

from __future__ import annotations

from typing import Any

import torch

from vllm_worker import envs


def enabled(device: torch.device) -> bool:
    return device.type == "cuda" and bool(envs.get("VLLM_LENS_GPU_CLOCK"))


def mark() -> Any:
    """A timing event recorded now on the current stream."""
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def resolve(clock: list) -> list:
    """`counters.FORWARD_CLOCK` entries as plain numbers: (start, end, cpu) for entries without device
    marks; with them, (start, end, cpu, device ms of the forward, device ms from its end to the next
    forward's start — sampling and the device's idle time; None for the latest)."""
    marked = [e for e in clock if len(e) == 5]
    if marked:
        marked[-1][4].synchronize()
    out: list = []
    for i, e in enumerate(clock):
        if len(e) != 5:
            out.append(tuple(e[:3]))
            continue
        nxt = clock[i + 1] if i + 1 < len(clock) and len(clock[i + 1]) == 5 else None
        gap = None if nxt is None else e[4].elapsed_time(nxt[3])
        out.append((e[0], e[1], e[2], e[3].elapsed_time(e[4]), gap))
    return out
