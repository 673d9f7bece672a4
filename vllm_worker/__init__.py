"""inspect-lens vLLM plugin: per-request capture, steering and hooks at any hook point inside vLLM."""

from vllm_worker.api.hooks import Hook, HookContext, HookError, UnsupportedError
from vllm_worker.api.patterns import attention_pattern
from vllm_worker.api.steering import SteeringVector

__all__ = [
    "AsyncLensClient",
    "Hook",
    "HookContext",
    "HookError",
    "UnsupportedError",
    "attention_pattern",
    "LensClient",
    "SteeringVector",
    "VLLMLensClient",
    "decode_activations",
    "decode_stream_chunk",
]


def __getattr__(name: str):
    # the HTTP client needs httpx: imported on first use, not by the worker processes
    if name in ("LensClient", "AsyncLensClient", "VLLMLensClient", "decode_activations", "decode_stream_chunk"):
        from vllm_worker.api import client

        return getattr(client, name)
    raise AttributeError(name)
