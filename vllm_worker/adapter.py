"""Every touch of a vLLM internal lives here, behind a version check.

If vLLM moves something we rely on, `check()` (run at plugin load and at engine start) raises a
`LensIncompatibleVLLM` naming it — the plugin never silently does nothing. `tests/test_adapter.py`
exercises each item against the installed vLLM.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any, Callable, Iterator

import numpy as np
import torch

logger = logging.getLogger("vllm_worker")

SUPPORTED = ((0, 26), (0, 34))  # [min, max) on (major, minor)


class LensIncompatibleVLLM(RuntimeError):
    """The installed vLLM lacks an internal the plugin needs."""


def vllm_version() -> tuple[int, int]:
    import vllm

    vt = getattr(vllm, "__version_tuple__", None)
    if vt and isinstance(vt[0], int) and isinstance(vt[1], int):
        return int(vt[0]), int(vt[1])
    m = re.match(r"(\d+)\.(\d+)", getattr(vllm, "__version__", ""))
    if not m:
        raise LensIncompatibleVLLM(f"cannot read the vLLM version ({getattr(vllm, '__version__', None)!r})")
    return int(m.group(1)), int(m.group(2))


def check_version() -> tuple[int, int]:
    v = vllm_version()
    lo, hi = SUPPORTED
    if not lo <= v < hi:
        raise LensIncompatibleVLLM(
            f"inspect-lens supports vLLM {lo[0]}.{lo[1]} up to (excluding) {hi[0]}.{hi[1]}; found {v[0]}.{v[1]}. "
            "Set VLLM_LENS_DISABLE=1 to run without the plugin."
        )
    return v


def _require(obj: Any, attr: str, where: str) -> Any:
    if not hasattr(obj, attr):
        raise LensIncompatibleVLLM(f"vLLM internal moved: {where}.{attr} not found (vLLM {vllm_version()})")
    return getattr(obj, attr)


def _wrap(cls: type, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace `cls.name` by `make(original)` once (idempotent across repeated plugin loads)."""
    orig = _require(cls, name, cls.__qualname__)
    if getattr(orig, "__lens_wrapped__", False):
        return
    new = make(orig)
    functools.update_wrapper(new, orig)
    new.__lens_wrapped__ = True  # type: ignore[attr-defined]
    setattr(cls, name, new)


# ---------------------------------------------------------------- frontend (engine construction)


def engine_args_cls() -> type:
    from vllm.engine.arg_utils import EngineArgs

    _require(EngineArgs, "create_engine_config", "EngineArgs")
    _require(EngineArgs, "worker_extension_cls", "EngineArgs")
    _require(EngineArgs, "enforce_eager", "EngineArgs")
    return EngineArgs


def force_v1_model_runner() -> None:
    """Our worker patches live on the V1 `GPUModelRunner`. vLLM >= 0.26 on GPU defaults non-MoE models to
    the V2 runner (`vllm/v1/worker/gpu/`), where they would silently never run: select V1 through its
    env switch (read when the engine config is built, inherited by worker processes), and refuse V2."""
    import os

    import vllm.envs as envs

    if "VLLM_USE_V2_MODEL_RUNNER" not in getattr(envs, "environment_variables", {}):
        return  # this vLLM has no V2 runner
    value = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower()
    if value in ("1", "true"):
        raise LensIncompatibleVLLM("inspect-lens hooks the V1 model runner; VLLM_USE_V2_MODEL_RUNNER=1 would make "
                                   "every capture/steering request a silent no-op. Unset it, or set "
                                   "VLLM_LENS_DISABLE=1 to run without the plugin.")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def patch_engine_args(adjust: Callable[[Any], Any]) -> None:
    """`adjust(engine_args) -> engine_args` runs before every engine config is built (offline and serve)."""

    def make(orig: Callable) -> Callable:
        def create_engine_config(self, *args, **kwargs):
            return orig(adjust(self), *args, **kwargs)

        return create_engine_config

    _wrap(engine_args_cls(), "create_engine_config", make)


def patch_splitting_ops(op: str) -> None:
    """Add our tap op to vLLM's piecewise-compilation `splitting_ops` (after vLLM filled in its defaults),
    so it runs eagerly between CUDA-graph pieces: a step with Python hooks can then still use piecewise
    graphs. Full graphs record the op's graph-safe kernel like any other. Empty lists (one flat graph)
    stay empty: there the op is inside the graph and steps with hooks run without graphs."""
    from vllm.config import CompilationConfig

    def make(orig: Callable) -> Callable:
        def set_splitting_ops_for_v1(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            if self.splitting_ops and op not in self.splitting_ops:
                self.splitting_ops.append(op)
            return out

        return set_splitting_ops_for_v1

    _wrap(CompilationConfig, "set_splitting_ops_for_v1", make)


def patch_endpoint_plugins(name: str, factory: Callable[[], Any]) -> None:
    """Plain `vllm serve`: vLLM loads endpoint plugins only when `VLLM_PLUGINS` names them. When
    `VLLM_PLUGINS` is unset (vLLM's default: every installed general plugin loads, ours included), add
    our HTTP routes too, so installing the package is enough. An explicit `VLLM_PLUGINS` list is the
    operator's choice and is respected."""
    import os

    import vllm.plugins as vp

    orig = _require(vp, "load_endpoint_plugins", "vllm.plugins")
    if getattr(orig, "__lens_wrapped__", False):
        return

    def load_endpoint_plugins(supported_tasks=None, *args, **kwargs):
        plugins = orig(supported_tasks, *args, **kwargs)
        if os.environ.get("VLLM_PLUGINS") is None and not any(getattr(p, "name", None) == name for p in plugins):
            ours = factory()
            if ours.required_tasks is None or set(ours.required_tasks) & set(supported_tasks or ()):
                plugins.append(ours)
        return plugins

    functools.update_wrapper(load_endpoint_plugins, orig)
    load_endpoint_plugins.__lens_wrapped__ = True  # type: ignore[attr-defined]
    vp.load_endpoint_plugins = load_endpoint_plugins


def patch_compile_hash(marker: str) -> None:
    """Mix `marker` into the compilation config's hash, which keys vLLM's compile cache: a graph compiled
    without our taps (a plugin-disabled run on the same machine) is then never reused by our engines."""
    from vllm.config import CompilationConfig

    def make(orig: Callable) -> Callable:
        def compute_hash(self, *args, **kwargs):
            import hashlib

            return hashlib.sha256(f"{orig(self, *args, **kwargs)}|{marker}".encode()).hexdigest()

        return compute_hash

    _wrap(CompilationConfig, "compute_hash", make)


# ---------------------------------------------------------------- frontend (per request)


def input_processor_cls() -> type:
    from vllm.v1.engine.input_processor import InputProcessor

    _require(InputProcessor, "process_inputs", "InputProcessor")
    return InputProcessor


def patch_process_inputs(post: Callable[[Any, str, Any], Any]) -> None:
    """`post(processor, external_request_id, engine_core_request)` sees every new request after vLLM
    cloned its `SamplingParams` (so we only ever edit vLLM's private copy)."""

    def make(orig: Callable) -> Callable:
        def process_inputs(self, request_id, prompt, params, *args, **kwargs):
            req = orig(self, request_id, prompt, params, *args, **kwargs)
            return post(self, request_id, req)

        return process_inputs

    _wrap(input_processor_cls(), "process_inputs", make)


@functools.cache
def validation_error_cls() -> type[ValueError]:
    """A `ValueError` that vLLM's API server also maps to HTTP 400 (a plain ValueError raised while
    adding a request becomes a 500 with an empty message there)."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return ValueError

    class LensValidationError(VLLMValidationError, ValueError):
        pass

    return LensValidationError


def _graceful_error_cls(base: type[Exception], status: str, name: str) -> type[Exception]:
    """A subclass of `base` that vLLM's API server answers with HTTP `status` (its GracefulHTTPError);
    plain `base` where vLLM has none."""
    try:
        from http import HTTPStatus

        from vllm.exceptions import GracefulHTTPError
    except ImportError:
        return base
    code = HTTPStatus[status]

    def __init__(self, message: str) -> None:
        GracefulHTTPError.__init__(self, message, code)

    return type(name, (GracefulHTTPError, base), {"__init__": __init__})


@functools.cache
def forbidden_error_cls() -> type[PermissionError]:
    """A `PermissionError` that vLLM's API server maps to HTTP 403."""
    return _graceful_error_cls(PermissionError, "FORBIDDEN", "LensForbidden")


@functools.cache
def capacity_error_cls() -> type[ValueError]:
    """A `ValueError` (offline) that vLLM's API server maps to HTTP 503: admission refused for now."""
    return _graceful_error_cls(ValueError, "SERVICE_UNAVAILABLE", "LensCapacity")


def request_prompt_len(req: Any) -> int:
    ids = getattr(req, "prompt_token_ids", None)
    if ids is not None:
        return len(ids)
    emb = getattr(req, "prompt_embeds", None)
    if emb is not None:
        return int(emb.shape[0])
    raise LensIncompatibleVLLM("EngineCoreRequest has neither prompt_token_ids nor prompt_embeds")


def set_request_cache_salt(req: Any, salt: str) -> None:
    _require(req, "cache_salt", "EngineCoreRequest")
    req.cache_salt = salt if not req.cache_salt else f"{req.cache_salt}|{salt}"


def model_shape(processor: Any) -> tuple[int, int]:
    """(n_layers, d_model) of the served model, from the processor's model config."""
    mc = _require(processor, "model_config", "InputProcessor")
    return int(mc.get_total_num_hidden_layers()), int(mc.get_hidden_size())


def model_capture_limits(processor: Any) -> tuple[int, int]:
    """(max_model_len, bytes per captured value) of the served model: bounds a request's capture."""
    mc = _require(processor, "model_config", "InputProcessor")
    dtype = _require(mc, "dtype", "ModelConfig")
    return int(_require(mc, "max_model_len", "ModelConfig")), torch.empty((), dtype=dtype).element_size()


def offline_mixin_cls() -> type:
    try:
        from vllm.entrypoints.common.offline import OfflineInferenceMixin as cls
    except ImportError:  # older vLLM keeps _run_engine on LLM itself
        from vllm.entrypoints.llm import LLM as cls
    _require(cls, "_run_engine", cls.__qualname__)
    _require(cls, "_add_request", cls.__qualname__)
    return cls


def patch_run_engine(post: Callable[[Any, list], list]) -> None:
    """`post(llm, outputs)` runs on the finished outputs of every `LLM.generate` / `LLM.chat`."""

    def make(orig: Callable) -> Callable:
        def _run_engine(self, *args, **kwargs):
            return post(self, orig(self, *args, **kwargs))

        return _run_engine

    _wrap(offline_mixin_cls(), "_run_engine", make)


def patch_offline_add_request(pre: Callable[[Any], None]) -> None:
    """`pre(llm)` before every request `LLM.generate` / `LLM.chat` adds (they all pass here)."""
    cls = offline_mixin_cls()

    def make(orig: Callable) -> Callable:
        def _add_request(self, *args, **kwargs):
            pre(self)
            return orig(self, *args, **kwargs)

        return _add_request

    _wrap(cls, "_add_request", make)


def patch_aborts(forget: Callable[[Any, list[str]], list[str]]) -> None:
    """Aborted requests (client disconnects, a later bad request in an offline list, cancellations) never
    reach a consumer: `forget(input_processor, request_ids) -> keys` drops their pending entries and the
    workers drop the keys' stores (`lens_drop`). Ids may be internal (`<id>-<8 hex>`) or external."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.llm_engine import LLMEngine

    def as_ids(request_id: Any) -> list[str]:
        return [request_id] if isinstance(request_id, str) else [str(r) for r in request_id]

    def make_async(orig: Callable) -> Callable:
        async def abort(self, request_id, *args, **kwargs):
            await orig(self, request_id, *args, **kwargs)
            keys = forget(self.input_processor, as_ids(request_id))
            if keys:
                await self.collective_rpc("lens_drop", args=(keys,))

        return abort

    def make_sync(orig: Callable) -> Callable:
        def abort_request(self, request_ids, *args, **kwargs):
            orig(self, request_ids, *args, **kwargs)
            keys = forget(self.input_processor, as_ids(request_ids))
            if keys:
                self.collective_rpc("lens_drop", args=(keys,))

        return abort_request

    _wrap(AsyncLLM, "abort", make_async)
    _wrap(LLMEngine, "abort_request", make_sync)


def processor_of_llm(llm: Any) -> Any:
    engine = _require(llm, "llm_engine", "LLM")
    return _require(engine, "input_processor", "LLMEngine")


def processor_of_llm_engine(engine: Any) -> Any:
    return _require(engine, "input_processor", "LLMEngine")


def llm_engine_cls() -> type:
    from vllm.v1.engine.llm_engine import LLMEngine

    _require(LLMEngine, "step", "LLMEngine")
    _require(LLMEngine, "add_request", "LLMEngine")
    return LLMEngine


def async_llm_cls() -> type:
    from vllm.v1.engine.async_llm import AsyncLLM

    _require(AsyncLLM, "generate", "AsyncLLM")
    return AsyncLLM


def patch_engine_loop(pre_add: Callable[[Any], None], post_step: Callable[[Any, list], list]) -> None:
    """`LLMEngine` driven directly: `pre_add(engine)` before each `add_request`, `post_step(engine,
    outputs)` on what each `step()` returns."""
    cls = llm_engine_cls()

    def make_add(orig: Callable) -> Callable:
        def add_request(self, *args, **kwargs):
            pre_add(self)
            return orig(self, *args, **kwargs)

        return add_request

    def make_step(orig: Callable) -> Callable:
        def step(self, *args, **kwargs):
            return post_step(self, orig(self, *args, **kwargs))

        return step

    _wrap(cls, "add_request", make_add)
    _wrap(cls, "step", make_step)


def _is_delta(sp: Any) -> bool:
    kind = getattr(sp, "output_kind", None)
    return kind is not None and getattr(kind, "name", "") == "DELTA"


def patch_async_generate(pre: Callable[[Any], bool], on_final: Callable[..., Any]) -> None:
    """`AsyncLLM.generate` (= AsyncLLMEngine): `pre(engine)` says whether this caller consumes results;
    then `await on_final(engine, output, request_id, generated, last)` runs on the request's finished
    output before it is yielded (`generated`: tokens per sample when outputs are deltas, else None;
    `last`: each sample's latest CompletionOutput)."""
    import inspect

    cls = async_llm_cls()
    if not inspect.isasyncgenfunction(cls.generate):
        raise LensIncompatibleVLLM("vLLM internal moved: AsyncLLM.generate is not an async generator")
    params = list(inspect.signature(cls.generate).parameters)
    if params[:4] != ["self", "prompt", "sampling_params", "request_id"]:
        raise LensIncompatibleVLLM(f"vLLM internal moved: AsyncLLM.generate{params}")

    def make(orig: Callable) -> Callable:
        async def generate(self, *args, **kwargs):
            mine = pre(self)
            request_id = kwargs.get("request_id", args[2] if len(args) > 2 else None)
            sp = kwargs.get("sampling_params", args[1] if len(args) > 1 else None)
            delta = _is_delta(sp)
            generated: dict[int, int] = {}  # DELTA outputs carry only new tokens: count them
            last: dict[int, Any] = {}  # each sample's latest CompletionOutput
            async for out in orig(self, *args, **kwargs):
                if mine:
                    for c in getattr(out, "outputs", ()):
                        last[c.index] = c
                        if delta:
                            generated[c.index] = generated.get(c.index, 0) + len(c.token_ids)
                    if getattr(out, "finished", False):
                        await on_final(self, out, request_id, generated if delta else None, last)
                yield out

        return generate

    _wrap(cls, "generate", make)


def processor_of_engine_client(engine_client: Any) -> Any:
    """The API server's `InputProcessor` (AsyncLLM keeps it in-process)."""
    return _require(engine_client, "input_processor", type(engine_client).__name__)


async def rpc_async(engine_client: Any, method: str, *args: Any) -> list:
    return await engine_client.collective_rpc(method, args=args)


def server_request_id(response_id: str, kind: str, prompt_index: int) -> str:
    """Engine request id behind one prompt of an OpenAI response: completions use
    `f"{response_id}-{i}"` per prompt; chat uses the response id (one prompt)."""
    if kind == "chat":
        return response_id
    return f"{response_id}-{prompt_index}"


def rpc(llm_or_engine: Any, method: str, *args: Any) -> list:
    return llm_or_engine.collective_rpc(method, args=args)


def add_output_defaults() -> None:
    """`RequestOutput.activations` / `CompletionOutput.activations` exist (None) on every output."""
    from vllm.outputs import CompletionOutput, RequestOutput

    for cls in (RequestOutput, CompletionOutput):
        for name in ("activations", "hook_results", "hook_error"):
            if not hasattr(cls, name):
                setattr(cls, name, None)


def add_llm_methods(methods: dict[str, Callable]) -> None:
    """Public methods on `vllm.LLM` (persistent hooks); never overrides one vLLM already has."""
    from vllm.entrypoints.llm import LLM

    for name, fn in methods.items():
        existing = getattr(LLM, name, None)
        if existing is not None and not getattr(existing, "__lens_wrapped__", False):
            raise LensIncompatibleVLLM(f"vllm.LLM already defines {name}; refusing to shadow it")
        fn.__lens_wrapped__ = True  # type: ignore[attr-defined]
        setattr(LLM, name, fn)


# ---------------------------------------------------------------- worker


_CHILD_RE = re.compile(r"^(\d+)_")


def child_index(worker_request_id: str, n: int) -> int:
    """Sample index of a worker request: vLLM fans `n > 1` out as `f"{i}_{internal_id}"`."""
    if n <= 1:
        return 0
    m = _CHILD_RE.match(worker_request_id)
    if not m:
        raise LensIncompatibleVLLM(f"cannot read the sample index of request {worker_request_id!r} (n={n})")
    return int(m.group(1))


def runner_classes() -> list[type]:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    classes = [GPUModelRunner]
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            from vllm.v1.worker.cpu_model_runner import CPUModelRunner

            classes.append(CPUModelRunner)
    except ImportError:
        pass
    for c in classes:
        _require(c, "load_model", c.__qualname__)
    _require(GPUModelRunner, "_model_forward", "GPUModelRunner")
    return classes


def patch_runner(on_loaded: Callable[[Any], None], around_forward: Callable[..., Any]) -> None:
    """`on_loaded(runner)` after the model is loaded; `around_forward(runner, orig, **kw)` wraps each
    forward pass (the forward context is set; `kw` holds input_ids / positions / ...)."""
    classes = runner_classes()

    def make_load(orig: Callable) -> Callable:
        def load_model(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            on_loaded(self)
            return out

        return load_model

    def make_forward(orig: Callable) -> Callable:
        def _model_forward(self, *args, **kwargs):
            return around_forward(self, orig, *args, **kwargs)

        return _model_forward

    for c in classes:
        if "load_model" in c.__dict__:
            _wrap(c, "load_model", make_load)
    _wrap(classes[0], "_model_forward", make_forward)


def patch_cudagraph_dispatch(needs_python: Callable[[Any], bool]) -> None:
    """`needs_python(runner)` is asked once per step, after vLLM laid out the batch and before it picks
    the step's CUDA-graph mode; True (the step runs Python hooks, or more than the graph-safe buffers
    hold) excludes FULL graphs from that choice: vLLM then replays piecewise graphs, between which our
    tap op (a splitting op) is called from Python, or no graph. Other steps keep vLLM's choice, full
    graphs included (the graph-safe kernel is recorded in them)."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    why = graph_taps_unsupported()
    if why is not None:
        raise LensIncompatibleVLLM(why)

    def make_dispatch(orig: Callable) -> Callable:
        def dispatch(self, *args, **kwargs):
            if getattr(self, "_lens_no_full", False):
                kwargs["invalid_modes"] = set(kwargs.get("invalid_modes") or ()) | {CUDAGraphMode.FULL}
            return orig(self, *args, **kwargs)

        return dispatch

    def make_determine(orig: Callable) -> Callable:
        def determine(self, *args, **kwargs):
            d = getattr(self, "cudagraph_dispatcher", None)
            if d is None or not needs_python(self):
                return orig(self, *args, **kwargs)
            d._lens_no_full = True
            try:
                return orig(self, *args, **kwargs)
            finally:
                d._lens_no_full = False

        return determine

    _wrap(CudagraphDispatcher, "dispatch", make_dispatch)
    _wrap(GPUModelRunner, "_determine_batch_execution_and_padding", make_determine)


def forward_replays_full_graph() -> bool:
    """Whether the running forward pass replays a full CUDA graph: no Python in the model is called
    then (between piecewise graphs, splitting ops such as our taps are)."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context

    return getattr(get_forward_context(), "cudagraph_runtime_mode", None) == CUDAGraphMode.FULL


def host_positions(runner: Any, qsl: Any) -> np.ndarray:
    """Positions of the step's rows, computed on the host the way vLLM computes them (computed tokens
    of the request + offset in its chunk), without reading the device."""
    ib = _require(runner, "input_batch", type(runner).__name__)
    start = _require(ib, "num_computed_tokens_cpu", "InputBatch")[: len(qsl) - 1]
    counts = np.diff(qsl)
    return np.repeat(start - qsl[:-1], counts) + np.arange(int(qsl[-1]))


def max_tokens(runner: Any) -> int:
    """Most rows a forward pass of this runner can have (graph padding included)."""
    n = int(_require(runner, "max_num_tokens", type(runner).__name__))
    cc = getattr(getattr(runner, "vllm_config", None), "compilation_config", None)
    return max(n, int(getattr(cc, "max_cudagraph_capture_size", None) or 0))


def hidden_size(runner: Any) -> int:
    return int(_require(runner, "model_config", type(runner).__name__).get_hidden_size())


def runner_model(runner: Any) -> torch.nn.Module:
    model = _require(runner, "model", type(runner).__name__)
    return model


def batch_layout(runner: Any) -> tuple[list[str], Any]:
    """(request ids in batch order, host query_start_loc) for the forward pass being run.

    Rows of request j are `qsl[j]:qsl[j+1]`. Read fresh every step: vLLM reorders the batch."""
    ib = _require(runner, "input_batch", type(runner).__name__)
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
    reqs = _require(runner, "requests", type(runner).__name__)
    st = reqs.get(req_id)
    sp = getattr(st, "sampling_params", None)
    return None if sp is None else sp.extra_args


def request_max_positions(runner: Any, req_id: str) -> int | None:
    """Most positions a request can reach (prompt + max_tokens - 1), or None if not known."""
    st = _require(runner, "requests", type(runner).__name__).get(req_id)
    n_prompt = getattr(st, "num_prompt_tokens", None)
    max_tokens = getattr(getattr(st, "sampling_params", None), "max_tokens", None)
    if not isinstance(n_prompt, int) or not isinstance(max_tokens, int):
        return None
    return n_prompt + max_tokens - 1


def live_request_ids(runner: Any) -> Any:
    return _require(runner, "requests", type(runner).__name__).keys()


def tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def decoder_layers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(global index, module) of the decoder layers this rank holds.

    Known layouts: `model.layers` (Llama/Qwen2/Mistral), `transformer.h` (GPT2), `model.decoder.layers`
    (OPT), nested under `language_model` for multimodal wrappers. Pipeline-parallel placeholders
    (`PPMissingLayer`) are skipped; indices stay global."""
    from vllm.model_executor.models.utils import PPMissingLayer

    candidates = []
    for root in (model, getattr(model, "language_model", None)):
        if root is None:
            continue
        for path in ("model.layers", "transformer.h", "model.decoder.layers", "model.model.layers", "layers"):
            obj: Any = root
            for part in path.split("."):
                obj = getattr(obj, part, None)
                if obj is None:
                    break
            if isinstance(obj, torch.nn.ModuleList) and len(obj) > 0:
                candidates.append(obj)
                break
        if candidates:
            break
    if not candidates:
        raise LensIncompatibleVLLM(
            f"cannot find the decoder layers of {type(model).__name__} "
            "(looked for model.layers, transformer.h, model.decoder.layers)"
        )
    layers = candidates[0]
    return [(i, m) for i, m in enumerate(layers) if not isinstance(m, PPMissingLayer)]


def residual_parts(output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Split a decoder layer's output into (hidden, residual-or-None).

    Fused layers return `(hidden, residual)`: the residual stream is their sum. Plain layers return
    the stream itself. Anything else is an error, never silently skipped."""
    if isinstance(output, torch.Tensor):
        return output, None
    if isinstance(output, tuple) and len(output) == 2 and isinstance(output[0], torch.Tensor):
        res = output[1]
        if res is None or isinstance(res, torch.Tensor):
            return output[0], res
    raise LensIncompatibleVLLM(f"unexpected decoder-layer output {type(output).__name__}")


def layer_inputs(args: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hidden, residual-or-None) of a decoder layer's positional inputs.

    Llama/Qwen2: `(positions, hidden, residual)` (residual None at layer 0; the stream entering the
    layer is hidden + residual). GPT2/OPT: `(hidden,)`."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            res = args[i + 1] if i + 1 < len(args) else None
            if res is not None and not (isinstance(res, torch.Tensor) and res.is_floating_point()):
                res = None
            return a, res
    raise LensIncompatibleVLLM("decoder layer called without a floating-point hidden-states argument")


_SUFFIX_RE = re.compile(r"-[0-9a-f]{8}$")


def external_request_id(worker_request_id: str, n: int) -> str:
    """The caller's request id: vLLM appends `-<8 hex>` and prefixes `<i>_` for sample i of n > 1."""
    rid = worker_request_id
    child = None
    if n > 1:
        child = child_index(rid, n)
        rid = rid.split("_", 1)[1]
    rid = _SUFFIX_RE.sub("", rid)
    return rid if child is None else f"{rid}#{child}"


def full_parameter(model: torch.nn.Module, name: str) -> torch.Tensor:
    """Parameter by dotted name, following attributes (tied weights have no entry of their own),
    gathered from its TP shards (vocab-parallel padding removed). `KeyError` if this rank lacks it."""
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather

    owner: Any = None
    param: Any = model
    for part in name.split("."):
        owner, param = param, getattr(param, part, None)
        if param is None:
            break
    if not isinstance(param, torch.Tensor):
        raise KeyError(f"no parameter {name!r} on this rank")
    if get_tensor_model_parallel_world_size() == 1:
        return param
    dim = getattr(param, "output_dim", None)
    if dim is None:
        dim = getattr(param, "input_dim", None)
    if dim is None:
        return param  # replicated
    full = tensor_model_parallel_all_gather(param.data.contiguous(), dim=dim)
    org = getattr(owner, "org_vocab_size", None)
    if org is not None and dim == 0:
        full = full[: org]
    return full


def ensure_pp_buffers(runner: Any) -> None:
    """vLLM's CPU worker skips the warm-up run that allocates the pipeline-parallel receive buffer on
    later stages (rank 1 then dies on `assert self.intermediate_tensors is not None`). Allocate it the
    way the warm-up would."""
    from vllm.distributed import get_pp_group

    if get_pp_group().is_first_rank or getattr(runner, "intermediate_tensors", None) is not None:
        return
    model = runner_model(runner)
    make = _require(model, "make_empty_intermediate_tensors", type(model).__name__)
    runner.intermediate_tensors = make(batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype,
                                       device=runner.device)


def pp_share(local: torch.Tensor | None, name: str) -> torch.Tensor:
    """Every pipeline stage gets the tensor that one stage holds (collective over the PP group)."""
    from vllm.distributed import get_pp_group

    pp = get_pp_group()
    if pp.world_size == 1:
        if local is None:
            raise KeyError(name)
        return local
    mine = None if local is None else (tuple(local.shape), str(local.dtype))
    owner = None
    for src in range(pp.world_size):
        meta = pp.broadcast_object(mine if pp.rank_in_group == src else None, src=src)
        if meta is not None and owner is None:
            owner = (src, meta)
    if owner is None:
        raise KeyError(name)
    src, (shape, dtype) = owner
    if pp.rank_in_group == src:
        buf = local.contiguous()
    else:
        buf = torch.empty(shape, dtype=getattr(torch, dtype.split(".")[-1]), device=pp.device)
    return pp.broadcast(buf, src=src)


def iter_stage_layers(runner: Any) -> Iterator[tuple[int, torch.nn.Module]]:
    yield from decoder_layers(runner_model(runner))


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
    for cls, name in ((CompilationConfig, "compute_hash"), (CompilationConfig, "set_splitting_ops_for_v1"),
                      (CudagraphDispatcher, "dispatch"),
                      (GPUModelRunner, "_determine_batch_execution_and_padding")):
        if not hasattr(cls, name):
            return f"vLLM internal moved: {cls.__qualname__}.{name} not found"
    if "invalid_modes" not in inspect.signature(CudagraphDispatcher.dispatch).parameters:
        return "vLLM internal moved: CudagraphDispatcher.dispatch has no invalid_modes parameter"
    if "cudagraph_runtime_mode" not in getattr(ForwardContext, "__dataclass_fields__", {}):
        return "vLLM internal moved: ForwardContext has no cudagraph_runtime_mode"
    return None


def check() -> None:
    """Everything the plugin needs, checked up front (plugin load in the frontend)."""
    check_version()
    engine_args_cls()
    input_processor_cls()
    offline_mixin_cls()


# ---------------------------------------------------------------- CPU LoRA: rows without an adapter


def patch_cpu_lora_no_adapter_rows() -> None:
    """vLLM's CPU LoRA ops (torch_ops.bgmv_*, used by PunicaWrapperCPU) gather `weights[index]` per
    token; a token with no adapter has index -1, which Python indexing turns into the *last* adapter
    slot. With one slot (max_loras=1, the default) a base-model request batched with a LoRA request gets
    that adapter applied. Rows with a negative index contribute nothing here, as on GPU.
    Only on the CPU platform: GPU kernels skip those rows themselves."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.lora.ops.torch_ops.lora_ops as ops
    import vllm.lora.punica_wrapper.punica_cpu as pcpu

    def masked(orig: Callable, index_arg: int, out_arg: int, out_cols: Callable[[tuple], slice] | None):
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            idx = args[index_arg]
            none = idx < 0
            if not bool(none.any()):
                return orig(*args, **kwargs)
            out = args[out_arg]
            cols = out_cols(args) if out_cols else slice(None)
            n = min(out.shape[0], idx.shape[0])
            mask = none[:n]
            keep = out[:n, cols][mask].clone()
            args = list(args)
            args[index_arg] = idx.clamp(min=0)
            result = orig(*args, **kwargs)
            view = out[:n, cols]
            view[mask] = keep  # rows without an adapter: exactly what they held before
            return result
        return wrapper

    # (function, position of the index tensor, position of the output tensor, output columns it writes)
    specs = {"bgmv_shrink": (3, 2, None), "bgmv_expand": (3, 2, None),
             "bgmv_expand_slice": (3, 2, lambda a: slice(a[4], a[4] + a[5]))}
    for name, (ii, oi, cols) in specs.items():
        orig = _require(ops, name, "vllm.lora.ops.torch_ops")
        if getattr(orig, "__lens_wrapped__", False):
            continue
        new = masked(orig, ii, oi, cols)
        functools.update_wrapper(new, orig)
        new.__lens_wrapped__ = True  # type: ignore[attr-defined]
        if _require(pcpu, name, "vllm.lora.punica_wrapper.punica_cpu") is not orig:
            raise LensIncompatibleVLLM(f"vLLM internal moved: punica_cpu.{name} is no longer torch_ops.{name}; "
                                       "rows without a LoRA adapter could get one (see adapter.py)")
        setattr(ops, name, new)
        setattr(pcpu, name, new)  # imported by name into the CPU wrapper's module
