"""User hooks: arbitrary Python run on one request's residual stream inside vLLM's batched forward.

`Hook(fn, layer_indices, point="resid_post")`; `fn(ctx, h) -> Tensor | None`. `h` is the activation at the
hook point for *that request's rows only*, shape `(rows, d_model)`: the stream leaving the layer
(`resid_post`), entering it (`resid_pre`, = `pre=True`; for layer 0: the embeddings), or the attention /
MLP block's output or the stream between them (`attn_out`, `mlp_out`, `resid_mid`: docs/hook-points.md). Returning a tensor of the same shape/dtype/device
replaces the stream for those rows; `None` leaves it.

`Hook(fn, layers, batched=True)`: `fn(ctx, h)` runs once per step and layer for *every* request of the step
that carries this hook (the same function, point and layers; persistent hooks: every request), on their
rows stacked in batch order; `ctx.rows` lists `(request_id, start, end)` into `h` and `ctx.saved` maps each
request id to its own saved dict. One call instead of one per request: fewer launches and no per-request
Python. A batched hook that raises fails every request it ran for in that call. `ctx.segment_ids`,
`ctx.counts` and `ctx.save_rows(name, values)` give per-request reductions and results without per-request
Python or a device sync.

`Hook(fn, layers, read_only=True)`: a promise that `fn` only reads `h` (returns None; returning a tensor
fails the request). When every hook of a step is read-only (hooks at `q` / `k` always are), the taps keep a
copy of the stream and the hooks run right after the step's forward pass has been sent to the device, so
the GPU computes the rest of the step while their Python runs instead of waiting for it. What a hook sees
is the same either way (the stream at its point); docs/hooks.md has the costs.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from pydantic import BaseModel, ConfigDict, StrictBool, field_serializer, field_validator, model_validator

from vllm_worker.api.steering import LayerIndices, Point, no_unknown_fields


class Hook(BaseModel):
    """`Hook(fn, layer_indices, pre=False, point=None)`: `fn(ctx, h)` runs on this request's rows after
    (or, with `pre=True`, entering) each listed layer, or at another hook `point` of it. A frozen pydantic model: `model_dump()` gives a JSON-able
    dict with `fn` as base64 cloudpickle (our HTTP form), which `Hook.model_validate` loads back — that
    unpickles, so only validate dumps you made (the server never builds a Hook from what it receives:
    remote hooks go through their own opt-in path)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True, extra="forbid")

    fn: Callable[..., Any]
    layer_indices: LayerIndices
    pre: StrictBool = False
    point: Optional[Point] = None  # None: "resid_pre" with pre=True, else "resid_post"
    batched: StrictBool = False  # one call per step and layer for all requests carrying it (module docstring)
    read_only: StrictBool = False  # fn returns None: it may run after the forward, on a copy (module docstring)

    def __init__(self, fn: Any = None, layer_indices: Any = None, pre: Any = False, **kwargs: Any) -> None:
        super().__init__(fn=fn, layer_indices=layer_indices, pre=pre, **kwargs)

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_fields(cls, data: Any) -> Any:
        return no_unknown_fields(cls, data)

    @model_validator(mode="after")
    def _pre_and_point(self) -> "Hook":
        if self.pre and self.point not in (None, "resid_pre"):
            raise ValueError(f"pre=True means point='resid_pre', got point={self.point!r}")
        return self

    @field_validator("fn", mode="before")
    @classmethod
    def _fn(cls, v: Any) -> Callable:
        if isinstance(v, (str, bytes)):  # a model_dump() of a Hook
            import cloudpickle

            v = cloudpickle.loads(base64.b64decode(v))
        if not callable(v):
            raise ValueError(f"expected a callable fn(ctx, h), got {type(v).__name__}")
        return v

    @field_serializer("fn")
    def _dump_fn(self, fn: Callable) -> str:
        import cloudpickle

        return base64.b64encode(cloudpickle.dumps(fn)).decode()

    __hash__ = object.__hash__


@dataclass
class HookContext:
    """What a hook sees. `saved` persists across layers and forward steps for this hook and request
    (it comes back as `RequestOutput.hook_results[str(hook_index)]`). A batched hook's `saved` maps each
    request id of `rows` to that request's saved dict, and `rows` says which rows of `h` are whose."""

    saved: dict
    layer_idx: int = -1
    point: str = "resid_post"  # the hook point `h` is read at (docs/hook-points.md)
    seq_len: int = 0
    request_id: str = ""
    tp_rank: int = 0
    model: Any = None
    _params: Any = field(default=None, repr=False)
    _rows: Any = field(default=None, repr=False)  # (step positions, start, end) or (positions, row index)
    rows: list[tuple[str, int, int]] | None = None  # batched hooks: (request id, start, end) into `h`
    _batch: Any = field(default=None, repr=False)  # batched hooks: the step's helpers (`edits.Batch`)

    def _batched(self, what: str) -> Any:
        if self._batch is None:
            raise TypeError(f"ctx.{what} is for batched hooks (Hook(..., batched=True))")
        return self._batch

    @property
    def segment_ids(self) -> torch.Tensor:
        """Batched hooks: for each row of `h`, the index in `rows` of the request it belongs to — a device
        LongTensor of shape `(rows of h,)`, for one-kernel per-request reductions (`index_add_`). Made once
        per batch composition with no device sync (a non-blocking copy from pinned memory); read-only."""
        return self._batched("segment_ids").segment_ids

    @property
    def counts(self) -> torch.Tensor:
        """Batched hooks: rows of each request of `rows`, a device LongTensor of shape `(len(rows),)`
        (as `segment_ids`: made once per batch composition, no device sync; read-only)."""
        return self._batched("counts").counts

    def save_rows(self, name: Any, values: torch.Tensor) -> None:
        """Batched hooks: `values[i]` is request `rows[i]`'s value: the same as
        `for i, (rid, _, _) in enumerate(ctx.rows): ctx.saved[rid][name] = values[i]`, without the
        per-request Python (one call per step; each request's value is split off when its results leave
        the worker). Inside the hook, `ctx.saved[rid][name]` then reads back as a `SavedRow`
        (`.value` gives the tensor); do not also write `name` per request in the same hook."""
        self._batched("save_rows").save_rows(name, values)

    @property
    def positions(self) -> torch.Tensor | None:
        """Absolute token positions of the rows `h` holds, shape `(rows,)` (made only when read: most
        hooks never look, and it is one device copy per request per layer per step)."""
        if self._rows is None:
            return None
        if len(self._rows) == 2:  # a batched hook: the rows it was given, in its order
            pos, idx = self._rows
            return pos.index_select(0, idx)
        pos, s, e = self._rows
        return pos[s:e].clone()

    def get_parameter(self, name: str) -> torch.Tensor:
        """The full (unsharded) parameter `name`, e.g. "lm_head.weight" or "model.norm.weight"."""
        return self._params(name)


class HookError(RuntimeError):
    """One or more requests failed: their hook raised or returned something invalid, or (rarely) our
    own code failed for them (the message says "inspect-lens internal error" and the stage; `internal` is
    True when every failure is ours).

    `failures` maps request id -> message with the hook's traceback; `outputs` holds every output of
    the call (failed ones included, with `.hook_error` set) so batch-mates' results are not lost."""

    def __init__(self, failures: dict[str, str], outputs: list | None = None, internal: bool = False) -> None:
        self.failures = failures
        self.outputs = outputs
        self.internal = internal  # every failure is our own code's, none the caller's hook
        lines = [f"request {rid}: {msg}" for rid, msg in failures.items()]
        super().__init__(
            ("inspect-lens request failed\n" if internal else "inspect-lens hook failed\n") + "\n".join(lines)
        )


class UnsupportedError(HookError, ValueError):
    """The served model cannot give what the request asked for (a hook point its layout lacks, a model
    whose decoder layers inspect-lens cannot find): a `ValueError`, like other bad input, carrying the
    outputs as `HookError` does."""

    def __init__(self, failures: dict[str, str], outputs: list | None = None) -> None:
        HookError.__init__(self, failures, outputs)
        self.args = ("inspect-lens request refused\n" + "\n".join(f"request {r}: {m}" for r, m in failures.items()),)
