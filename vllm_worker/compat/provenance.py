"""What a probe score depends on besides the probe: the serving set-up read from the engine's config.
Thresholds drift with dtype, weight quantization, the KV-cache dtype, parallel layout and vLLM version,
so eval logs and calibrated probe files record these beside every score."""

from __future__ import annotations

import importlib.metadata as md
from typing import Any

from vllm_worker.compat.version import require


def plugin_version() -> str:
    try:
        return md.version("inspect-lens")
    except md.PackageNotFoundError:  # run from a source tree without an install
        return "unknown"


def serving_provenance(processor: Any) -> dict[str, Any]:
    """JSON-able provenance of the engine behind an input processor (a frontend's or an `LLM`'s)."""
    import vllm

    vc = require(processor, "vllm_config", "InputProcessor")
    mc = require(vc, "model_config", "VllmConfig")
    pc = require(vc, "parallel_config", "VllmConfig")
    cc = require(vc, "cache_config", "VllmConfig")
    quant = require(mc, "quantization", "ModelConfig")
    return {
        "vllm_version": str(vllm.__version__),
        "plugin_version": plugin_version(),
        "model": str(require(mc, "model", "ModelConfig")),
        "revision": require(mc, "revision", "ModelConfig"),
        "dtype": str(require(mc, "dtype", "ModelConfig")).removeprefix("torch."),
        "quantization": None if quant is None else str(quant),
        "kv_cache_dtype": str(require(cc, "cache_dtype", "CacheConfig")),
        "tensor_parallel_size": int(require(pc, "tensor_parallel_size", "ParallelConfig")),
        "pipeline_parallel_size": int(require(pc, "pipeline_parallel_size", "ParallelConfig")),
        "data_parallel_size": int(require(pc, "data_parallel_size", "ParallelConfig")),
    }
