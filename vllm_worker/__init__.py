"""inspect-lens vLLM plugin: per-request residual-stream capture, steering and hooks inside vLLM."""

from .hooks import Hook, HookContext, HookError
from .steering import SteeringVector

__all__ = ["Hook", "HookContext", "HookError", "SteeringVector"]
