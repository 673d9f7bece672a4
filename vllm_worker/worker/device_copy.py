"""Host tensors to the device without stalling the step's stream (pinned memory, asynchronous copy)."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` on `device`. On CUDA from pinned memory, asynchronously in the stream's order (a copy
    from pageable memory waits for the stream); torch's caching host allocator keeps the pinned buffer
    until the copy is done."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def distinct_rows(rows: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Host rows (1-D, one dtype and length) that are one row in memory counted once: the distinct ones, and
    each row's place among them. Rows that live tensors share (a memo's: equal requests) cross to the device
    once and are spread there (`torch.index_select`), byte for byte what copying each would give."""
    seen: dict[tuple[int, int], int] = {}  # (address, stride): live tensors never give two contents one
    out: list[torch.Tensor] = []
    which: list[int] = []
    n = 0  # len(out)
    for row in rows:
        j = seen.setdefault((row.data_ptr(), row.stride(0)), n)
        if j == n:
            out.append(row)
            n += 1
        which.append(j)
    return out, which
