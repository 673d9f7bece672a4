"""vLLM 0.34 removed the V1 model runner (`vllm/v1/worker/gpu_model_runner.py`, see
bench/results/2026-12-03-drift-0.34.md). On such a vLLM the plugin must stop with a `LensIncompatibleVLLM`
naming the runner, not a bare ImportError and never a plugin that loads and hooks nothing."""

from __future__ import annotations

import sys

import pytest

from vllm_worker import compat


def test_a_vllm_without_the_v1_runner_is_refused_by_kind(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_model_runner", None)  # `import` raises ImportError
    with pytest.raises(compat.LensIncompatibleVLLM) as err:
        compat.runner_classes()
    assert "gpu_model_runner.GPUModelRunner" in str(err.value)
    with pytest.raises(compat.LensIncompatibleVLLM):
        compat.patch_runner(lambda runner: None, lambda runner, orig, *a, **kw: orig(runner, *a, **kw))


def test_the_installed_vllm_has_it():
    assert compat.runner_classes()
