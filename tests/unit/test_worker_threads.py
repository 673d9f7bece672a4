"""A worker makes a new batch composition's plan (admission, the steering's flush, the plan) and a fetch's
probe scores in one torch thread, and torch's pool is as it was after it (`host_threads.one_thread`); a step
whose batch is unchanged never resizes the pool (docs/decisions.md, "seventeenth session");
`VLLM_LENS_WORKER_ONE_THREAD=0` leaves the pool alone."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from vllm_worker import compat
from vllm_worker.protocol import host_threads
from vllm_worker.worker import extension, probe_payloads, runtime
from vllm_worker.worker.runtime import LensRuntime

pytestmark = pytest.mark.skipif(not host_threads._OPENMP, reason="torch's pool is resized only with OpenMP")


class _Planned(LensRuntime):
    """The runtime's step hook with the plan itself replaced by a record of the pool's size."""

    def __init__(self) -> None:  # (no model: only the plan's bookkeeping)
        self.runner = object()
        self._plan_key = None
        self._cached_plan = None
        self.pools: list[int] = []

    def _replan(self, req_ids: list, qsl: np.ndarray, key: tuple) -> None:
        self.pools.append(torch.get_num_threads())
        self._plan_key = key


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch, resizable_pool: None) -> list[int]:
    """The pool's size each time the runtime asks for one thread (after it); batches from `layout` below."""
    calls: list[int] = []

    @contextmanager
    def counted(enabled: bool = True) -> Iterator[None]:
        with host_threads.one_thread(enabled):
            yield
        calls.append(torch.get_num_threads() if enabled else -1)

    monkeypatch.setattr(runtime, "one_thread", counted)
    monkeypatch.setattr(compat, "batch_layout", lambda runner: layout[0])
    return calls


layout: list[tuple[list[str], np.ndarray]] = [([], np.zeros(1, dtype=np.int32))]


def _step(rt: _Planned, req_ids: list[str]) -> None:
    layout[0] = (req_ids, np.arange(len(req_ids) + 1, dtype=np.int32))
    rt._current_plan()


def test_a_new_batch_is_planned_in_one_thread_and_an_unchanged_one_resizes_nothing(steps: list[int]) -> None:
    torch._C.set_num_threads(2)
    rt = _Planned()
    _step(rt, ["a", "b"])
    assert rt.pools == [1] and steps == [2]
    for _ in range(5):  # decode steps of the same batch: no re-plan, no resize
        _step(rt, ["a", "b"])
    assert rt.pools == [1] and steps == [2]
    _step(rt, ["a"])  # one left: a new composition
    assert rt.pools == [1, 1] and steps == [2, 2]


def test_the_setting_off_leaves_the_pool_alone(steps: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_LENS_WORKER_ONE_THREAD", "0")
    torch._C.set_num_threads(2)
    rt = _Planned()
    _step(rt, ["a"])
    assert rt.pools == [2] and steps == [-1]


def test_the_step_hook_asks_the_runtime_and_a_runner_without_one_plans_nothing() -> None:
    class Runtime:
        def prepare_step(self) -> int:
            return 7

    class Runner:
        _lens_runtime: Any = Runtime()

    class Bare:
        pass

    assert extension._needs_python(Runner()) == 7
    assert extension._needs_python(Bare()) == 0


@pytest.mark.parametrize("setting", ["1", "0"])
def test_a_fetchs_probe_scores_are_assembled_in_one_thread(
    setting: str, monkeypatch: pytest.MonkeyPatch, resizable_pool: None
) -> None:
    monkeypatch.setenv("VLLM_LENS_WORKER_ONE_THREAD", setting)
    seen: list[int] = []

    def payloads(requests: list, cache: dict, starts: Any, blocks: bool) -> list:
        seen.append(torch.get_num_threads())
        return [b"p"] * len(requests)

    monkeypatch.setattr(probe_payloads, "payloads", payloads)
    torch._C.set_num_threads(2)
    assert probe_payloads.together(["a", "b"], {}) == [b"p", b"p"]
    assert seen == [1 if setting == "1" else 2] and torch.get_num_threads() == 2
