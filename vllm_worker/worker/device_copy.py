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
