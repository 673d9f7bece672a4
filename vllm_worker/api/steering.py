"""`SteeringVector`: what a caller asks to add to the residual stream of their own request.

A pydantic model (vLLM already depends on pydantic): type errors surface where the object is made, with
the field named; `model_dump()` gives a JSON-able dict (activations as our tensor object) that
`SteeringVector.model_validate` reads back; `model_copy(update=...)` makes variants. Checks that need the
served model (d_model, layer range, prompt length, finite values) happen when a request is submitted.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

import torch
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    StrictBool,
    field_serializer,
    field_validator,
    model_validator,
)

from vllm_worker.protocol import ops as intervention
from vllm_worker.protocol import points as pts
from vllm_worker.protocol.checks import finite_number, int_list
from vllm_worker.protocol.clone_scope import tensors_shared
from vllm_worker.protocol.host_threads import one_thread
from vllm_worker.protocol.wire import tensor_from_json, tensor_to_json

# A tensor object inside a model_validate() input is bounded like one arriving over HTTP.
MAX_TENSOR_BYTES = 256 << 20


def layer_indices(value: Any) -> list[int]:
    """The `layer_indices` field of SteeringVector and Hook: a non-empty list of ints (no bools)."""
    out = int_list(value, "layer_indices")
    if not out:
        raise ValueError("layer_indices: empty")
    return out


# the field type of `layer_indices` in SteeringVector and Hook
LayerIndices = Annotated[list[int], BeforeValidator(layer_indices)]


def _point(value: Any) -> str:
    return pts.point_name(value, "point")


# the field type of `point` (a hook-point name: docs/hook-points.md)
Point = Annotated[str, BeforeValidator(_point)]


def no_unknown_fields(cls: type[BaseModel], data: Any) -> Any:
    """An unknown keyword is an error naming it and the closest field (a typo such as `normmatch=True`
    would otherwise be dropped without a word, and the request run without it)."""
    if isinstance(data, dict):
        unknown = [k for k in data if k not in cls.model_fields]
        if unknown:
            hint = pts.closest(str(unknown[0]), cls.model_fields)
            raise ValueError(
                f"{cls.__name__}: unknown field {unknown[0]!r}{hint}; fields: {', '.join(cls.model_fields)}"
            )
    return data


_ATOMIC = (type(None), str, float, int, bool)  # what `copy.deepcopy` returns as it is
_INTS = {int}


def _copied_fields(fields: dict[str, Any], memo: dict[int, Any]) -> dict[str, Any] | None:
    """A validated vector's fields as `copy.deepcopy` makes them, without its walk: values it returns as they
    are, lists of plain ints copied (recorded in `memo` as it records them), the tensor as `memo` holds it.
    None for anything else (a tensor not in `memo`, other containers): the caller then takes the full walk."""
    out: dict[str, Any] = {}
    for k, v in fields.items():
        t = type(v)
        if t in _ATOMIC:
            out[k] = v
        elif id(v) in memo:
            out[k] = memo[id(v)]
        elif t is list and set(map(type, v)) <= _INTS:
            out[k] = memo[id(v)] = v.copy()
            memo.setdefault(id(memo), []).append(v)  # (deepcopy's `_keep_alive`: the id stays this list's)
        else:
            return None
    return out


def _plain(t: Any) -> bool:
    """A dense tensor without autograd state or attributes of its own: `clone()` copies all it holds."""
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and not t.requires_grad
        and t.grad_fn is None
        and not t.__dict__
    )


class SteeringVector(BaseModel):
    """Vectors added to the residual stream after the listed decoder layers (or at another hook `point`).

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
    point: where in each listed layer the vector is added: "resid_post" (default, the stream leaving the
        layer), "resid_pre", "attn_out", "resid_mid", "mlp_in", "mlp_out", "mlp_post" (the MLP's
        neurons: vectors d_mlp wide; ablate / cap / norm_match act over the whole row) or "z" (the heads' outputs before the output
        projection; docs/hook-points.md); `norm_match` then uses the norm of the activation at that point.
    heads: with point="z", the heads the vector goes to: activations are then `(n_layers, d_head)` (or
        `(n_layers, n_pos, d_head)`), added to each listed head. Without activations (`None`), the listed
        heads' outputs are multiplied by `scale` instead — `scale=0.0` ablates them.
    op: what the entry does at its site (docs/capture-and-steering.md, "Interventions"): "add" (the
        default, as above), "ablate" (`x <- x - (x·d)d` with `d` the unit direction of the row), "cap"
        (clamp `x·d` into `[lo, hi]`, the orthogonal part untouched) or "set" (the activation replaced by
        the row; with point="z" and heads, those heads only). `scale` and `norm_match` belong to "add".
    phase: the positions it applies to: "all" (default), "prompt" (prompt positions) or "generated" (the
        positions of generated tokens: the forward pass of each generated token fed back; the first
        generated token is sampled from the last prompt position, so "generated" never changes it).
    lo, hi: the range of op="cap" (either may be omitted).
    name: instead of `activations`, a vector registered on the engine (`llm.register_vector(name, t)`,
        HTTP `POST /v1/lens/vectors`): `SteeringVector(name="happy", layer_indices=[15], scale=4.0)`. A
        1-D registered vector is added at every listed layer; otherwise as `activations`.

    Positional or keyword construction: `SteeringVector(v, [15], scale=4.0)`. Immutable (frozen); the
    plugin never modifies it and copies it when the request is submitted.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True, extra="forbid")

    activations: Optional[torch.Tensor]
    layer_indices: LayerIndices
    scale: float = 1.0
    norm_match: StrictBool = False
    position_indices: Optional[list[int]] = None
    point: Point = pts.RESID_POST
    heads: Optional[list[int]] = None
    name: Optional[str] = None
    op: str = "add"
    phase: str = "all"
    lo: Optional[float] = None
    hi: Optional[float] = None

    def __init__(
        self,
        activations: Any = None,
        layer_indices: Any = None,
        scale: Any = 1.0,
        norm_match: Any = False,
        position_indices: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            activations=activations,
            layer_indices=layer_indices,
            scale=scale,
            norm_match=norm_match,
            position_indices=position_indices,
            **kwargs,
        )

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_fields(cls, data: Any) -> Any:
        return no_unknown_fields(cls, data)

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> SteeringVector:
        """pydantic's deep copy, its tensor copy in one thread: vLLM deep-copies each request's sampling
        params (and so this vector) on the submitting thread, where torch's thread pool costs more than
        the copy (protocol/host_threads.py). A plain tensor is cloned directly (torch's `__deepcopy__`
        enters no_grad and copies the whole storage: slow on a busy host), handed to pydantic through memo."""
        memo = {} if memo is None else memo
        acts = self.activations
        with one_thread():
            if acts is not None and _plain(acts) and id(acts) not in memo:
                # (vLLM's own clone, read and dropped by our frontend in the same call: `clone_scope`)
                memo[id(acts)] = acts if tensors_shared() else acts.clone()
            plain = self.__pydantic_private__ is None and self.__pydantic_extra__ is None
            fields = _copied_fields(self.__dict__, memo) if plain else None
            if fields is None:  # (anything but the validated plain values: pydantic's own deep copy)
                return super().__deepcopy__(memo)
            m = type(self).__new__(type(self))
            memo[id(self)] = m
            object.__setattr__(m, "__dict__", fields)
            object.__setattr__(m, "__pydantic_extra__", None)
            object.__setattr__(m, "__pydantic_fields_set__", set(self.__pydantic_fields_set__))
            object.__setattr__(m, "__pydantic_private__", None)
            return m

    @field_validator("activations", mode="before")
    @classmethod
    def _tensor(cls, v: Any) -> torch.Tensor | None:
        if v is None:
            return None
        if isinstance(v, dict):  # our tensor object (model_dump / HTTP form)
            return tensor_from_json(v, "activations", max_bytes=MAX_TENSOR_BYTES)
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"expected a torch.Tensor (or a tensor object), got {type(v).__name__}")
        if not v.is_floating_point():
            raise ValueError(f"expected a floating-point tensor, got {v.dtype}")
        return v

    @field_validator("name", mode="before")
    @classmethod
    def _name(cls, v: Any) -> str | None:
        if v is None:
            return None
        from vllm_worker.protocol.checks import vector_name

        return vector_name(v, "name")

    @field_validator("position_indices", mode="before")
    @classmethod
    def _positions(cls, v: Any) -> list[int] | None:
        return None if v is None else int_list(v, "position_indices")

    @field_validator("scale", mode="before")
    @classmethod
    def _scale(cls, v: Any) -> float:
        return finite_number(v, "scale")

    @field_validator("op", mode="before")
    @classmethod
    def _op(cls, v: Any) -> str:
        return intervention.op_name(v)

    @field_validator("phase", mode="before")
    @classmethod
    def _phase(cls, v: Any) -> str:
        return intervention.phase_name(v)

    @field_validator("lo", "hi", mode="before")
    @classmethod
    def _bound(cls, v: Any, info: Any) -> float | None:
        return intervention.bound(v, info.field_name)

    @field_validator("heads", mode="before")
    @classmethod
    def _heads(cls, v: Any) -> list[int] | None:
        return None if v is None else int_list(v, "heads")

    @model_validator(mode="after")
    def _heads_need_z(self) -> "SteeringVector":
        if self.heads is not None and self.point != pts.Z:
            raise ValueError(f"heads: only with point='z', got point={self.point!r}")
        three_d = self.position_indices is not None or (self.activations is not None and self.activations.ndim == 3)
        intervention.check_fields(
            self.op,
            self.phase,
            self.lo,
            self.hi,
            self.scale,
            self.norm_match,
            self.activations is not None or self.name is not None,
            three_d,
        )
        if self.activations is not None:
            intervention.check_directions(self.op, self.activations)
        if self.name is not None:
            if self.activations is not None:
                raise ValueError("name: give either name (a registered vector) or activations, not both")
            return self
        if self.activations is None and self.heads is None:
            raise ValueError(
                "activations: required (or the name of a registered vector; only point='z' with heads may "
                "omit them, to scale those heads)"
            )
        return self

    @field_serializer("activations")
    def _dump_tensor(self, v: torch.Tensor | None) -> dict | None:
        return None if v is None else tensor_to_json(v)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SteeringVector):
            return NotImplemented
        return (
            self.layer_indices == other.layer_indices
            and self.scale == other.scale
            and self.norm_match == other.norm_match
            and self.position_indices == other.position_indices
            and self.point == other.point
            and self.heads == other.heads
            and self.name == other.name
            and (self.op, self.phase, self.lo, self.hi) == (other.op, other.phase, other.lo, other.hi)
            and (self.activations is None) == (other.activations is None)
            and (
                self.activations is None
                or other.activations is None
                or (
                    self.activations.shape == other.activations.shape
                    and torch.equal(self.activations.cpu(), other.activations.cpu())
                )
            )
        )

    __hash__ = object.__hash__
