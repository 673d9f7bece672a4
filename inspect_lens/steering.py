"""Steering vectors referenced by name, so eval configs and logs carry a short name instead of a tensor.

    register_steering_vector("honesty", SteeringVector(v, [15], scale=4.0))
    GenerateConfig(extra_body={"extra_args": {"apply_steering_vectors": ["honesty"]}})
    steer("honesty")            # the solver

Names resolve in this process when the request is sent (the provider encodes the tensors then)."""

from __future__ import annotations

from typing import Any, Sequence

from vllm_worker.api.steering import SteeringVector

_REGISTRY: dict[str, SteeringVector] = {}


def register_steering_vector(name: str, vector: SteeringVector) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError("register_steering_vector: name must be a non-empty string")
    if not isinstance(vector, SteeringVector):
        raise ValueError(f"register_steering_vector: expected a SteeringVector, got {type(vector).__name__}")
    _REGISTRY[name] = vector


def steering_vector(name: str) -> SteeringVector:
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "none registered"
        raise ValueError(f"apply_steering_vectors: unknown steering vector name {name!r} (known: {known})") from None


def resolve_vectors(vectors: Any) -> list[SteeringVector]:
    """SteeringVector | name | a list of those -> a list of SteeringVectors."""
    if isinstance(vectors, (SteeringVector, str)):
        vectors = [vectors]
    if not isinstance(vectors, Sequence):
        raise ValueError(f"apply_steering_vectors: expected SteeringVectors or names, got {type(vectors).__name__}")
    out = []
    for v in vectors:
        if isinstance(v, str):
            out.append(steering_vector(v))
        elif isinstance(v, SteeringVector):
            out.append(v)
        else:
            raise ValueError(
                "apply_steering_vectors: wrap tensors in SteeringVector(activations, layer_indices) "
                f"or register them by name (got {type(v).__name__})"
            )
    return out
