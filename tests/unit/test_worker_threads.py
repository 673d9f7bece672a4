"""A worker's host work for a step (the plan made in `extension._needs_python`: admission, the steering's
flush, the plan) and for its results' RPCs (`lens_fetch`, `lens_probe_progress`) runs in one torch thread,
and torch's pool is as it was after each (`host_threads.one_thread`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm_worker.protocol import host_threads
from vllm_worker.worker import extension

pytestmark = pytest.mark.skipif(not host_threads._OPENMP, reason="torch's pool is resized only with OpenMP")


class _Runtime:
    """Reports the pool's size where the worker's code would run."""

    def prepare_step(self) -> int:
        return torch.get_num_threads()

    def fetch(self, wanted: list, shm_host: str | None, released: list | None) -> dict:
        return {"threads": torch.get_num_threads(), "wanted": wanted}

    def probe_progress(self, wanted: list) -> list:
        return [torch.get_num_threads(), wanted]


class _Runner:
    _lens_runtime: Any = _Runtime()


class _Worker(extension.LensWorkerExtension):
    model_runner = _Runner()


def test_the_step_plan_and_the_result_rpcs_run_in_one_thread(resizable_pool: None) -> None:
    torch._C.set_num_threads(2)
    assert extension._needs_python(_Runner()) == 1
    assert torch.get_num_threads() == 2
    got = _Worker().lens_fetch([("k", {"0": "3"})])
    assert got == {"threads": 1, "wanted": [("k", {0: 3})]}
    assert _Worker().lens_probe_progress([("k", "0", "5")]) == [1, [("k", 0, 5)]]
    assert torch.get_num_threads() == 2


def test_a_runner_without_the_runtime_plans_nothing() -> None:
    class Bare:
        pass

    assert extension._needs_python(Bare()) == 0
