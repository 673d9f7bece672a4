"""inspect-lens vLLM plugin: per-request residual-stream capture, steering and hooks inside vLLM."""

from vllm_worker.api.hooks import Hook, HookContext, HookError
from vllm_worker.api.steering import SteeringVector

__all__ = [
    "AsyncLensClient",
    "Hook",
    "HookContext",
    "HookError",
    "LensClient",
    "SteeringVector",
    "VLLMLensClient",
    "decode_activations",
]


def __getattr__(name: str):
    # the HTTP client needs httpx: imported on first use, not by the worker processes
    if name in ("LensClient", "AsyncLensClient", "VLLMLensClient", "decode_activations"):
        from vllm_worker.api import client

        return getattr(client, name)
    raise AttributeError(name)
