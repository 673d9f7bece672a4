"""What callers build and hold: `SteeringVector`, `Hook` (and what a hook sees, `HookContext`), `HookError`,
and the HTTP client (`client`). Nothing here imports vLLM: these run in the caller's process."""

from vllm_worker.api.hooks import Hook, HookContext, HookError  # noqa: F401
from vllm_worker.api.steering import SteeringVector  # noqa: F401
