"""The frontend's view of a request: the input processor every new request passes, the offline / engine
/ async loops whose outputs we complete, aborts, the model's shape and limits, and RPC to the workers."""

from __future__ import annotations

from typing import Any, Callable

import torch

from vllm_worker.compat.data_parallel import forget_routes, rpc_engines
from vllm_worker.compat.layouts import head_shape, kv_heads, missing_points, mlp_width, moe_shape
from vllm_worker.compat.version import LensIncompatibleVLLM, require, wrap
from vllm_worker.protocol.clone_scope import sharing_tensors
from vllm_worker.protocol.rpc import DROP


def input_processor_cls() -> type:
    from vllm.v1.engine.input_processor import InputProcessor

    require(InputProcessor, "process_inputs", "InputProcessor")
    return InputProcessor


def patch_process_inputs(post: Callable[[Any, str, Any], Any]) -> None:
    """`post(processor, external_request_id, engine_core_request)` sees every new request after vLLM
    cloned its `SamplingParams` (so we only ever edit vLLM's private copy). That clone shares the steering
    vectors' tensors (`protocol.clone_scope`): `post` reads them and drops them from `extra_args`."""

    def make(orig: Callable) -> Callable:
        def process_inputs(self, request_id, prompt, params, *args, **kwargs):
            with sharing_tensors():
                req = orig(self, request_id, prompt, params, *args, **kwargs)
            return post(self, request_id, req)

        return process_inputs

    wrap(input_processor_cls(), "process_inputs", make)


def request_prompt_len(req: Any) -> int:
    ids = getattr(req, "prompt_token_ids", None)
    if ids is not None:
        return len(ids)
    emb = getattr(req, "prompt_embeds", None)
    if emb is not None:
        return int(emb.shape[0])
    raise LensIncompatibleVLLM("EngineCoreRequest has neither prompt_token_ids nor prompt_embeds")


def set_request_cache_salt(req: Any, salt: str) -> None:
    require(req, "cache_salt", "EngineCoreRequest")
    req.cache_salt = salt if not req.cache_salt else f"{req.cache_salt}|{salt}"


def model_shape(processor: Any) -> tuple[int, int, dict[str, str], int, int, int, int, int, int]:
    """(n_layers, d_model, {hook point it lacks: why}, n_heads, d_head, n_experts, experts per token,
    n_kv_heads, d_mlp) of the served model, from the processor's model config (the points: `compat.layouts`)."""
    mc = require(processor, "model_config", "InputProcessor")
    return (
        int(mc.get_total_num_hidden_layers()),
        int(mc.get_hidden_size()),
        missing_points(mc.hf_config),
        *head_shape(mc.hf_config),
        *moe_shape(mc.hf_config),
        kv_heads(mc.hf_config),
        mlp_width(mc.hf_config),
    )


def model_capture_limits(processor: Any) -> tuple[int, int]:
    """(max_model_len, bytes per captured value) of the served model: bounds a request's capture."""
    mc = require(processor, "model_config", "InputProcessor")
    dtype = require(mc, "dtype", "ModelConfig")
    return int(require(mc, "max_model_len", "ModelConfig")), torch.empty((), dtype=dtype).element_size()


def offline_mixin_cls() -> type:
    try:
        from vllm.entrypoints.common.offline import OfflineInferenceMixin as cls
    except ImportError:  # older vLLM keeps _run_engine on LLM itself
        from vllm.entrypoints.llm import LLM as cls
    require(cls, "_run_engine", cls.__qualname__)
    require(cls, "_add_request", cls.__qualname__)
    return cls


def patch_run_engine(post: Callable[[Any, list], list]) -> None:
    """`post(llm, outputs)` runs on the finished outputs of every `LLM.generate` / `LLM.chat`."""

    def make(orig: Callable) -> Callable:
        def _run_engine(self, *args, **kwargs):
            return post(self, orig(self, *args, **kwargs))

        return _run_engine

    wrap(offline_mixin_cls(), "_run_engine", make)


def patch_offline_add_request(pre: Callable[[Any], None]) -> None:
    """`pre(llm)` before every request `LLM.generate` / `LLM.chat` adds (they all pass here)."""
    cls = offline_mixin_cls()

    def make(orig: Callable) -> Callable:
        def _add_request(self, *args, **kwargs):
            pre(self)
            return orig(self, *args, **kwargs)

        return _add_request

    wrap(cls, "_add_request", make)


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
                forget_routes(self, keys)
                await self.collective_rpc(DROP, args=(keys,))  # reaches every data-parallel engine

        return abort

    def make_sync(orig: Callable) -> Callable:
        def abort_request(self, request_ids, *args, **kwargs):
            orig(self, request_ids, *args, **kwargs)
            keys = forget(self.input_processor, as_ids(request_ids))
            if keys:
                self.collective_rpc(DROP, args=(keys,))

        return abort_request

    wrap(AsyncLLM, "abort", make_async)
    wrap(LLMEngine, "abort_request", make_sync)


def processor_of_llm(llm: Any) -> Any:
    engine = require(llm, "llm_engine", "LLM")
    return require(engine, "input_processor", "LLMEngine")


def input_processor_of(obj: Any) -> Any:
    """The `InputProcessor` of an `LLM`, `LLMEngine`, `AsyncLLM` / engine client, or the processor itself."""
    if hasattr(obj, "llm_engine"):
        return processor_of_llm(obj)
    if hasattr(obj, "input_processor"):
        return obj.input_processor
    return obj


def processor_of_llm_engine(engine: Any) -> Any:
    return require(engine, "input_processor", "LLMEngine")


def llm_engine_cls() -> type:
    from vllm.v1.engine.llm_engine import LLMEngine

    require(LLMEngine, "step", "LLMEngine")
    require(LLMEngine, "add_request", "LLMEngine")
    return LLMEngine


def async_llm_cls() -> Any:
    from vllm.v1.engine.async_llm import AsyncLLM

    require(AsyncLLM, "generate", "AsyncLLM")
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

    wrap(cls, "add_request", make_add)
    wrap(cls, "step", make_step)


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
        async def generate(self, *args: Any, **kwargs: Any) -> Any:
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

    wrap(cls, "generate", make)


def processor_of_engine_client(engine_client: Any) -> Any:
    """The API server's `InputProcessor` (AsyncLLM keeps it in-process)."""
    return require(engine_client, "input_processor", type(engine_client).__name__)


async def rpc_async(engine_client: Any, method: str, *args: Any, engine: int | None = None) -> list:
    """Every worker's answer (of every data-parallel engine: vLLM's own `collective_rpc` keeps only the
    first engine's), or only those of data-parallel engine `engine`."""
    answers = await rpc_engines(engine_client, method, args, engine)
    return await engine_client.collective_rpc(method, args=args) if answers is None else answers


def rpc(llm_or_engine: Any, method: str, *args: Any) -> list:
    return llm_or_engine.collective_rpc(method, args=args)
