"""inspect-lens vLLM plugin: per-request residual-stream capture and steering inside vLLM."""

from .steering import SteeringVector

__all__ = ["SteeringVector"]
