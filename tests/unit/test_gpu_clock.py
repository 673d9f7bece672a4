"""The benchmarks' device clock: forward entries with device marks resolve to device ms of the forward and
to the next forward's start; entries without them stay as they are; off on CPU whatever the setting."""

from __future__ import annotations

import pytest
import torch

from vllm_worker.worker import gpu_clock


class _Mark:
    """A device timing event's interface, at a known device time (ms)."""

    def __init__(self, at_ms: float) -> None:
        self.at_ms = at_ms
        self.synced = False

    def elapsed_time(self, other: _Mark) -> float:
        return other.at_ms - self.at_ms

    def synchronize(self) -> None:
        self.synced = True


def test_resolve_device_and_between() -> None:
    last = _Mark(31.0)
    clock = [(1.0, 1.1, 0.5), (2.0, 2.1, 0.6, _Mark(10.0), _Mark(18.0)), (3.0, 3.1, 0.7, _Mark(20.5), last)]
    got = gpu_clock.resolve(clock)
    assert got[0] == (1.0, 1.1, 0.5)
    assert got[1] == (2.0, 2.1, 0.6, 8.0, 2.5)
    assert got[2] == (3.0, 3.1, 0.7, 10.5, None)
    assert last.synced  # read only once the device reached the latest mark


def test_off_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_LENS_GPU_CLOCK", "1")
    assert not gpu_clock.enabled(torch.device("cpu"))
