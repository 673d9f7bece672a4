"""A worker's host work for a step's plan (made in `extension._needs_python`: admission, the steering's
flush, the plan) runs in one torch thread, and torch's pool is as it was after it (`host_threads.one_thread`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm_worker.protocol import host_threads
from vllm_worker.worker import extension

pytestmark = pytest.mark.skipif(not host_threads._OPENMP, reason="torch's pool is resized only with OpenMP")


class _Runtime:
    """Reports the pool's size where the worker's plan would be made."""

    def prepare_step(self) -> int:
        return torch.get_num_threads()


class _Runner:
    _lens_runtime: Any = _Runtime()


def test_the_step_plan_runs_in_one_thread(resizable_pool: None) -> None:
    torch._C.set_num_threads(2)
    assert extension._needs_python(_Runner()) == 1
    assert torch.get_num_threads() == 2


def test_a_runner_without_the_runtime_plans_nothing() -> None:
    class Bare:
        pass

    assert extension._needs_python(Bare()) == 0
