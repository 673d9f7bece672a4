"""The adapter is the only place touching vLLM internals: it must fail loudly if vLLM moves them."""

from __future__ import annotations

import os

import pytest
import torch
from vllm import SamplingParams

from vllm_worker import compat


def test_installed_vllm_has_everything_we_need(llama):
    """After an engine started (plugins loaded, worker extension imported) every patch is in place."""
    assert compat.check_version() >= (0, 26)
    compat.check()
    from vllm.config import CompilationConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.common.offline import OfflineInferenceMixin
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import DPLBAsyncMPClient
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert compat.graph_taps_unsupported() is None
    for fn in (
        EngineArgs.create_engine_config,
        InputProcessor.process_inputs,
        OfflineInferenceMixin._run_engine,
        OfflineInferenceMixin._add_request,
        GPUModelRunner._model_forward,
        CPUModelRunner.load_model,
        CompilationConfig.compute_hash,
        CompilationConfig.set_splitting_ops_for_v1,
        CudagraphDispatcher.dispatch,
        GPUModelRunner._determine_batch_execution_and_padding,
        AsyncLLM.abort,
        LLMEngine.abort_request,
        LLMEngine.add_request,
        LLMEngine.step,
        AsyncLLM.generate,
        DPLBAsyncMPClient.get_core_engine_for_request,  # data parallel: which engine ran a request
    ):
        assert getattr(fn, "__lens_wrapped__", False), fn
    from vllm.config import ParallelConfig

    # read by the workers: router logits are refused when vLLM splits MoE blocks' tokens across ranks
    assert isinstance(ParallelConfig.use_sequence_parallel_moe, property)


def test_every_engine_hooks_every_layer_and_the_hooks_fire(llama):
    runner = llama.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    rt = runner._lens_runtime
    assert rt.layer_ids == [0, 1, 2, 3]
    before = rt.steps_with_features
    llama.generate(
        ["the water"], SamplingParams(max_tokens=2, extra_args={"output_residual_stream": [0]}), use_tqdm=False
    )
    assert rt.steps_with_features >= before + 2
    # the plugin leaves compilation alone: eager only where the test session asked for it
    from support.engines import COMPILED

    assert llama.llm_engine.vllm_config.model_config.enforce_eager is (not COMPILED)
    assert (
        llama.llm_engine.vllm_config.parallel_config.worker_extension_cls
        == "vllm_worker.worker.extension.LensWorkerExtension"
    )


def test_missing_internal_is_a_loud_error(monkeypatch):
    class Empty:
        pass

    with pytest.raises(compat.LensIncompatibleVLLM, match="moved"):
        compat.require(Empty, "process_inputs", "InputProcessor")
    monkeypatch.setattr(compat.version, "vllm_version", lambda: (0, 99))
    with pytest.raises(compat.LensIncompatibleVLLM, match="supports vLLM"):
        compat.check_version()


def test_lora_ranks_the_provider_rounds_to_are_the_ones_vllm_serve_accepts():
    """inspect_lens.provider starts `vllm-lens serve --max-lora-rank R` with R rounded up to one of these."""
    from typing import get_args, get_type_hints

    from vllm.config.lora import LoRAConfig

    from inspect_lens.provider import VLLM_LORA_RANKS

    assert get_args(get_type_hints(LoRAConfig)["max_lora_rank"]) == VLLM_LORA_RANKS


def test_unknown_layer_layout_and_output_are_errors():
    with pytest.raises(compat.LensIncompatibleVLLM, match="decoder layers"):
        compat.decoder_layers(torch.nn.Linear(2, 2))
    with pytest.raises(compat.LensIncompatibleVLLM, match="decoder-layer output"):
        compat.residual_parts((1, 2, 3))
    h, r = compat.residual_parts((torch.ones(2), torch.zeros(2)))
    assert r is not None
    assert compat.child_index("2_abc-123", 3) == 2 and compat.child_index("abc", 1) == 0
    with pytest.raises(compat.LensIncompatibleVLLM):
        compat.child_index("abc-123", 3)


def test_v2_model_runner_is_refused_not_silently_ignored(monkeypatch):
    """Our patches live on the V1 runner; asking for V2 must fail loudly, the default must select V1."""
    from vllm_worker import compat

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(compat.LensIncompatibleVLLM, match="VLLM_USE_V2_MODEL_RUNNER"):
        compat.force_v1_model_runner()
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    compat.force_v1_model_runner()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_compile_cache_key_carries_the_taps(llama):
    """vLLM keys its compile cache by the compilation config's hash: ours differs from vLLM's own, so a
    graph compiled by a plugin-disabled run (no taps) is never reused (see test_compiled too)."""
    from vllm.config import CompilationConfig, CompilationMode

    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
    assert CompilationConfig.compute_hash.__lens_wrapped__
    assert cc.compute_hash() != CompilationConfig.compute_hash.__wrapped__(cc)
    assert cc.compute_hash() == CompilationConfig(mode=CompilationMode.VLLM_COMPILE).compute_hash()


def test_compile_cache_key_carries_the_inner_points(llama, monkeypatch):
    """A graph compiled with other inner taps (VLLM_LENS_POINTS) is never reused: it would lack (or carry)
    the taps this engine placed."""
    from vllm.config import CompilationConfig, CompilationMode

    keys = set()
    for value in ("", "all", "mlp_out", "attn_out,mlp_out"):
        monkeypatch.setenv("VLLM_LENS_POINTS", value)
        keys.add(CompilationConfig(mode=CompilationMode.VLLM_COMPILE).compute_hash())
    assert len(keys) == 4


def test_tap_op_is_a_piecewise_splitting_op_next_to_attention(llama):
    """Piecewise compilation (the GPU default) splits the graph at our tap, so Python hooks can run
    between CUDA-graph pieces; a flat graph (empty splitting_ops) keeps it inside and stays flat."""
    from vllm.config import CompilationConfig, CompilationMode

    from vllm_worker.worker.taps import OP

    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
    cc.set_splitting_ops_for_v1(all2all_backend="naive")
    assert OP in cc.splitting_ops and any("attention" in op for op in cc.splitting_ops)
    flat = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, splitting_ops=[])
    flat.set_splitting_ops_for_v1(all2all_backend="naive")
    assert flat.splitting_ops == []


def test_python_hook_steps_never_dispatch_to_a_full_cuda_graph(llama):
    """A full graph replays recorded kernels only: a step that runs Python hooks must not use one. While
    vLLM picks that step's mode, FULL is excluded (piecewise graphs remain: the tap op splits them).
    Other steps keep vLLM's choice (the graph-safe kernel is recorded in full graphs)."""
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode, VllmConfig
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    cfg = VllmConfig()
    cfg.compilation_config = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        cudagraph_capture_sizes=[1, 2, 4, 8],
        max_cudagraph_capture_size=8,
    )
    cfg.compilation_config.set_splitting_ops_for_v1(all2all_backend="naive")
    d = CudagraphDispatcher(cfg)
    d.initialize_cudagraph_keys(CUDAGraphMode.FULL_AND_PIECEWISE, uniform_decode_query_len=1)
    assert d.dispatch(num_tokens=8, uniform_decode=True)[0] == CUDAGraphMode.FULL  # vLLM's own choice
    d._lens_no_full = True
    mode, desc = d.dispatch(num_tokens=8, uniform_decode=True)
    assert mode == CUDAGraphMode.PIECEWISE and desc.num_tokens == 8


def test_capture_admission_reads_the_model_config_and_vllm_maps_refusals_to_status_codes(llama):
    """Admission (frontend._admit_capture) needs max_model_len and the dtype from the processor's model
    config, and vLLM's GracefulHTTPError to answer 503; a moved attribute is a loud error."""
    from types import SimpleNamespace

    proc = compat.processor_of_llm(llama)
    assert compat.model_capture_limits(proc) == (512, 4)  # the tiny engine: max_model_len 512, float32
    from http import HTTPStatus

    err = compat.capacity_error_cls()("full")
    assert isinstance(err, ValueError) and err.http_status == HTTPStatus.SERVICE_UNAVAILABLE
    with pytest.raises(compat.LensIncompatibleVLLM, match="max_model_len"):
        compat.model_capture_limits(SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32)))


def test_server_api_keys_are_read_where_vllm_reads_them(monkeypatch):
    """Named vectors are scoped per API key: the keys come from `--api-key` (vLLM's FrontendArgs.api_key,
    a list) or VLLM_API_KEY, as vLLM's auth middleware reads them; a moved field is a loud error."""
    from types import SimpleNamespace

    from vllm.entrypoints.launchers.cli_args import FrontendArgs, make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert "api_key" in FrontendArgs.__dataclass_fields__
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--api-key", "a", "b"])
    assert compat.api_keys(args) == ["a", "b"]
    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    assert compat.api_keys(SimpleNamespace(api_key=None)) == ["env-key"]
    monkeypatch.delenv("VLLM_API_KEY")
    assert compat.api_keys(SimpleNamespace(api_key=None)) == []
    with pytest.raises(compat.LensIncompatibleVLLM, match="api_key"):
        compat.api_keys(SimpleNamespace())


def test_offline_extract_internals(llama):
    """`vllm-lens extract` builds its engine from `vllm serve` flags and reads the served model."""
    from support.engines import model_path

    path = str(model_path("llama"))
    args = compat.engine_args_from_cli(path, ["--dtype", "float32", "--max-model-len", "256", "--enforce-eager"])
    assert (args.model, args.dtype, args.max_model_len, args.enforce_eager) == (path, "float32", 256, True)
    name, dtype, max_len = compat.served_model(compat.processor_of_llm(llama))
    assert name.endswith("tiny-llama") and dtype == torch.float32 and max_len == 512
    assert compat.llm_busy(llama) is False
    # the extractor's params are copied shallowly per request (vLLM's skip_clone), each request its own object
    sp = compat.shared_sampling_params(max_tokens=1, extra_args={"output_activations": '{"resid_post":[1]}'})
    copy = sp.clone()
    assert copy is not sp and copy.extra_args is sp.extra_args and sp.max_tokens == 1
