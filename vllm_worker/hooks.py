"""User hooks: arbitrary Python run on one request's residual stream inside vLLM's batched forward.

`Hook(fn, layer_indices, pre=False)`; `fn(ctx, h) -> Tensor | None`. `h` is the residual stream of
*that request's rows only*, shape `(rows, d_model)`: after the layer for a post-hook, entering the layer
for a pre-hook (for layer 0: the embeddings). Returning a tensor of the same shape/dtype/device
replaces the stream for those rows; `None` leaves it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch


@dataclass(frozen=True)
class Hook:
    fn: Callable[["HookContext", torch.Tensor], torch.Tensor | None]
    layer_indices: Sequence[int]
    pre: bool = False


@dataclass
class HookContext:
    """What a hook sees. `saved` persists across layers and forward steps for this hook and request
    (it comes back as `RequestOutput.hook_results[str(hook_index)]`)."""

    saved: dict
    layer_idx: int = -1
    seq_len: int = 0
    positions: torch.Tensor | None = None
    request_id: str = ""
    tp_rank: int = 0
    model: Any = None
    _params: Any = field(default=None, repr=False)

    def get_parameter(self, name: str) -> torch.Tensor:
        """The full (unsharded) parameter `name`, e.g. "lm_head.weight" or "model.norm.weight"."""
        return self._params(name)


class HookError(RuntimeError):
    """One or more requests failed because their hook raised or returned something invalid.

    `failures` maps request id -> message with the hook's traceback; `outputs` holds every output of
    the call (failed ones included, with `.hook_error` set) so batch-mates' results are not lost."""

    def __init__(self, failures: dict[str, str], outputs: list | None = None) -> None:
        self.failures = failures
        self.outputs = outputs
        lines = [f"request {rid}: {msg}" for rid, msg in failures.items()]
        super().__init__("inspect-lens hook failed\n" + "\n".join(lines))
