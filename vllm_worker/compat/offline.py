"""What `vllm-lens extract` needs from vLLM: the served model's name and dtype, an `LLM` built from
`vllm serve`-style engine flags (vLLM's own parser, so every engine flag works as it does there), and its
orderly shutdown."""

from __future__ import annotations

from typing import Any

import torch

from vllm_worker.compat.version import require


def served_model(processor: Any) -> tuple[str, torch.dtype, int]:
    """(model name or path, dtype, max_model_len) of the engine behind an input processor."""
    mc = require(processor, "model_config", "InputProcessor")
    return (
        str(require(mc, "model", "ModelConfig")),
        require(mc, "dtype", "ModelConfig"),
        int(require(mc, "max_model_len", "ModelConfig")),
    )


def _parser_cls() -> type:
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older vLLM
        from vllm.utils import FlexibleArgumentParser  # type: ignore[no-redef]  # the same class, its old home
    return FlexibleArgumentParser


def engine_args_from_cli(model: str, argv: list[str], prog: str = "vllm-lens extract") -> Any:
    """`EngineArgs` from `vllm serve` engine flags (`--dtype float32 --max-model-len 2048 ...`); vLLM's
    parser reports an unknown or malformed flag and exits (status 2), like `vllm serve`."""
    from vllm.engine.arg_utils import EngineArgs

    require(EngineArgs, "add_cli_args", "EngineArgs")
    require(EngineArgs, "from_cli_args", "EngineArgs")
    parser = EngineArgs.add_cli_args(_parser_cls()(prog=prog))
    return EngineArgs.from_cli_args(parser.parse_args([*argv, "--model", model]))


def llm_from_engine_args(engine_args: Any) -> Any:
    from vllm import LLM

    return require(LLM, "from_engine_args", "LLM")(engine_args)


def shared_sampling_params(**kwargs: Any) -> Any:
    """`SamplingParams(**kwargs)` for the thousands of requests of one `LLM.generate` call, which vLLM then
    copies shallowly for each request (`skip_clone`, as its own offline beam search does) instead of deep-
    copying them: the deep copy is a large share of a short request's host time (docs/decisions.md). Safe for
    our requests: the frontend replaces the copy's `extra_args` (never edits it in place). Plain params when
    this vLLM has no `skip_clone` or its `clone()` would hand back the caller's own object."""
    from vllm import SamplingParams

    require(SamplingParams, "clone", "SamplingParams")
    try:
        sp = SamplingParams(skip_clone=True, **kwargs)
    except TypeError:
        return SamplingParams(**kwargs)
    if sp.clone() is sp:  # each request must get an object of its own
        return SamplingParams(**kwargs)
    return sp


def llm_busy(llm: Any) -> bool:
    """The `LLM` has requests of its own in flight (a `generate` interrupted by Ctrl-C leaves them)."""
    engine = require(llm, "llm_engine", "LLM")
    return bool(require(engine, "has_unfinished_requests", "LLMEngine")())


SHUTDOWN_S = 60.0  # how long an engine's processes get to exit on their own (vLLM's default is 5 s)


def shutdown_engine(engine: Any, timeout: float = SHUTDOWN_S) -> None:
    """Stop the processes of an `LLM`, `LLMEngine` or `AsyncLLM` now and wait for them: left to vLLM's
    exit-time finalizer, an engine core still busy after its 5 s is killed before it unlinks its shared
    memory (Python's resource tracker then warns of a leaked `shared_memory` object), and logs after the
    caller's streams are closed."""
    own = getattr(type(engine), "shutdown", None)
    if own is not None:  # AsyncLLM: also stops its output handler
        own(engine, timeout=timeout)
        return
    inner = getattr(engine, "llm_engine", engine)  # `LLM` holds an `LLMEngine`
    core = require(inner, "engine_core", "LLMEngine")
    require(core, "shutdown", "EngineCoreClient")(timeout=timeout)
