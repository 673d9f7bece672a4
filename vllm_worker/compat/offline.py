"""What `vllm-lens extract` needs from vLLM: the served model's name and dtype, and an `LLM` built from
`vllm serve`-style engine flags (vLLM's own parser, so every engine flag works as it does there)."""

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
        from vllm.utils import FlexibleArgumentParser  # type: ignore[no-redef]
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


def llm_busy(llm: Any) -> bool:
    """The `LLM` has requests of its own in flight (a `generate` interrupted by Ctrl-C leaves them)."""
    engine = require(llm, "llm_engine", "LLM")
    return bool(require(engine, "has_unfinished_requests", "LLMEngine")())
