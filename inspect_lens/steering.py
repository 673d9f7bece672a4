"""Steering vectors referenced by name, so eval configs and logs carry a short name instead of a tensor.

    register_steering_vector("honesty", SteeringVector(v, [15], scale=4.0))
    GenerateConfig(extra_body={"extra_args": {"apply_steering_vectors": ["honesty"]}})
    steer("honesty")            # the solver

Names resolve in this process when the request is sent. The provider then uploads each tensor once to
its server, named by its content (`POST /v1/lens/vectors`), and each request names it there: requests,
eval logs and the `steer()` solver's logged arguments carry names and parameters, never the tensor.
A `SteeringVector(name=...)` or `{"name": ...}` entry may also name a vector registered on the server
by other means (`LensClient.register_vector`)."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

import torch

from vllm_worker.api.steering import SteeringVector

_REGISTRY: dict[str, SteeringVector] = {}
# tensors of this process by their content name (`content_name`): what the provider uploads
_TENSORS: dict[str, torch.Tensor] = {}


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
    out: list[SteeringVector] = []
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


def content_name(t: torch.Tensor) -> str:
    """The server-side name of a tensor: a hash of its dtype, shape and bytes (equal tensors share it,
    so each is uploaded once per server). The tensor is remembered for the upload."""
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}|{list(t.shape)}|".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    name = "sv-" + h.hexdigest()[:32]
    _TENSORS.setdefault(name, t.clone())
    return name


def local_tensor(name: str) -> torch.Tensor | None:
    """The tensor behind a content name made in this process (None for a name registered elsewhere)."""
    return _TENSORS.get(name)


def named_entry(v: SteeringVector) -> dict[str, Any]:
    """A steering entry as JSON naming its vector instead of carrying it (head scaling carries none)."""
    # (op and phase only where they are not the defaults: a plain vector's entry reads as it always did)
    dumped = v.model_dump(exclude={"activations"})
    entry = {
        k: val for k, val in dumped.items() if val is not None and (k, val) not in (("op", "add"), ("phase", "all"))
    }
    if v.activations is not None:
        entry["name"] = content_name(v.activations)
    return entry


def named_entries(vectors: Any) -> list[dict[str, Any]]:
    """SteeringVectors | local names | `{"name": ...}` entries | a list of those -> JSON entries naming
    their vectors (what requests send and logs show)."""
    if isinstance(vectors, (SteeringVector, str, dict)):
        vectors = [vectors]
    if not isinstance(vectors, Sequence):
        raise ValueError(f"apply_steering_vectors: expected SteeringVectors or names, got {type(vectors).__name__}")
    out = []
    for v in vectors:
        if isinstance(v, dict):
            if "activations" in v or not isinstance(v.get("name"), str):
                raise ValueError(
                    "apply_steering_vectors: a dict entry names a vector: {'name': ..., 'layer_indices': [...]} "
                    f"(got keys {sorted(v)})"
                )
            json.dumps(v)  # JSON-able, or a clear error now
            out.append(dict(v))
        else:
            out.extend(named_entry(sv) for sv in resolve_vectors(v))
    return out
