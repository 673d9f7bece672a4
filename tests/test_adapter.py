"""The adapter is the only place touching vLLM internals: it must fail loudly if vLLM moves them."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from vllm_worker import adapter


def test_installed_vllm_has_everything_we_need(llama):
    """After an engine started (plugins loaded, worker extension imported) every patch is in place."""
    assert adapter.check_version() >= (0, 26)
    adapter.check()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.common.offline import OfflineInferenceMixin
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for fn in (EngineArgs.create_engine_config, InputProcessor.process_inputs,
               OfflineInferenceMixin._run_engine, GPUModelRunner._model_forward, CPUModelRunner.load_model):
        assert getattr(fn, "__lens_wrapped__", False), fn


def test_every_engine_hooks_every_layer_and_the_hooks_fire(llama):
    runner = llama.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    rt = runner._lens_runtime
    assert rt.layer_ids == [0, 1, 2, 3]
    before = rt.steps_with_features
    llama.generate(["the water"], SamplingParams(max_tokens=2, extra_args={"output_residual_stream": [0]}),
                   use_tqdm=False)
    assert rt.steps_with_features >= before + 2
    assert llama.llm_engine.vllm_config.model_config.enforce_eager is True
    assert llama.llm_engine.vllm_config.parallel_config.worker_extension_cls == \
        "vllm_worker.worker_ext.LensWorkerExtension"


def test_missing_internal_is_a_loud_error(monkeypatch):
    class Empty:
        pass

    with pytest.raises(adapter.LensIncompatibleVLLM, match="moved"):
        adapter._require(Empty, "process_inputs", "InputProcessor")
    monkeypatch.setattr(adapter, "vllm_version", lambda: (0, 99))
    with pytest.raises(adapter.LensIncompatibleVLLM, match="supports vLLM"):
        adapter.check_version()


def test_unknown_layer_layout_and_output_are_errors():
    with pytest.raises(adapter.LensIncompatibleVLLM, match="decoder layers"):
        adapter.decoder_layers(torch.nn.Linear(2, 2))
    with pytest.raises(adapter.LensIncompatibleVLLM, match="decoder-layer output"):
        adapter.residual_parts((1, 2, 3))
    h, r = adapter.residual_parts((torch.ones(2), torch.zeros(2)))
    assert r is not None
    assert adapter.child_index("2_abc-123", 3) == 2 and adapter.child_index("abc", 1) == 0
    with pytest.raises(adapter.LensIncompatibleVLLM):
        adapter.child_index("abc-123", 3)
