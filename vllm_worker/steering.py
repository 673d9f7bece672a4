"""`SteeringVector`: what a caller asks to add to the residual stream of their own request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class SteeringVector:
    """Vectors added to the residual stream after the listed decoder layers.

    activations: `(n_layers, d_model)` — added at every position (prompt and generated), or
        `(n_layers, n_pos, d_model)` — row `p` added only at absolute token position
        `position_indices[p]` (default `0..n_pos-1`), once per forward pass of that position, never at
        other positions. Row `i` of the first axis belongs to `layer_indices[i]`.
    layer_indices: decoder layers after which the vector is added (negative counts from the end).
    scale: multiplier. With `norm_match=False` the added vector is `scale * v`.
    norm_match: when True the added vector is `scale * ||r|| * v / ||v||`, where `r` is the residual
        stream at that position after the layer (before any addition) — i.e. the vector is rescaled to
        the norm of the activation it is added to, per position.
    position_indices: absolute token positions for 3-D activations; must lie inside the prompt.

    The object is never modified by the plugin; it is copied when the request is submitted.
    """

    activations: torch.Tensor
    layer_indices: Sequence[int]
    scale: float = 1.0
    norm_match: bool = False
    position_indices: Sequence[int] | None = None
