"""What a caller asks for, checked: our keys in `extra_args` (offline objects — `SteeringVector`, `Hook` —
or their JSON forms over HTTP) validated against the served model's shape, each error a `ValueError` naming
the field (`PermissionError` for remote hooks without opt-in), turned into the `RequestSpec` that
`protocol.spec` encodes for the workers. Runs in the frontend, before any compute."""

from __future__ import annotations

import base64
import os
from types import SimpleNamespace
from typing import Any, Mapping

import torch

from vllm_worker.api.hooks import Hook
from vllm_worker.api.steering import SteeringVector
from vllm_worker.frontend import actions as action_keys
from vllm_worker.frontend import mlp_post
from vllm_worker.frontend import probes as probe_keys
from vllm_worker.frontend import saes as sae_keys
from vllm_worker.frontend.steer_rows import checked_rows
from vllm_worker.protocol import ops as intervention
from vllm_worker.protocol import points as pts
from vllm_worker.protocol.checks import finite_number, int_list
from vllm_worker.protocol.spec import (
    ACTIONS_KEY,
    ACTIVATIONS_KEY,
    CAPTURE_KEY,
    HOOK_KEY,
    KNOWN_KEYS,
    NAMESPACE_PREFIXES,
    PROBE_KEYS,
    SAE_KEYS,
    STEER_KEY,
    HookSpec,
    ModelShape,
    RequestSpec,
    Steer,
    capture_layers,
    capture_points,
    capture_sites,
    from_json_string,
    layer_list,
    max_payload_bytes,
    require_remote_hooks,
)
from vllm_worker.protocol.wire import tensor_from_json


def _steering_item(item: Any, i: int | str, shape: ModelShape, prompt_len: int) -> Steer:
    """`i`: the item's index in `apply_steering_vectors`, or the full name of the field it came in."""
    f = i if isinstance(i, str) else f"{STEER_KEY}[{i}]"
    if isinstance(item, Mapping):
        unknown = set(item) - STEER_FIELDS
        if unknown:
            name = sorted(unknown)[0]
            raise ValueError(f"{f}: unknown fields {sorted(unknown)}{pts.closest(name, STEER_FIELDS)}")
        if "layer_indices" not in item or ("activations" not in item and "heads" not in item):
            raise ValueError(f"{f}: needs 'activations' and 'layer_indices'")
        # checked field by field below, with messages naming the request's field (not as a model)
        item = SimpleNamespace(
            activations=item.get("activations"),
            layer_indices=item["layer_indices"],
            scale=item.get("scale", 1.0),
            norm_match=item.get("norm_match", False),
            position_indices=item.get("position_indices"),
            point=item.get("point", pts.RESID_POST),
            heads=item.get("heads"),
            op=item.get("op", "add"),
            phase=item.get("phase", "all"),
            lo=item.get("lo"),
            hi=item.get("hi"),
        )
    elif not isinstance(item, SteeringVector):
        raise ValueError(f"{f}: expected a SteeringVector, got {type(item).__name__}")
    point = pts.point_name(item.point, f"{f}.point")
    pts.check_available(point, f"{f}.point", shape.missing)
    if point in pts.NOT_STEERABLE:
        raise ValueError(f"{f}.point: {point!r} can be captured and hooked, not steered")
    heads = _heads(item.heads, point, f, shape)
    op = intervention.op_name(item.op, f"{f}.op")
    phase = intervention.phase_name(item.phase, f"{f}.phase")
    lo, hi = intervention.bound(item.lo, f"{f}.lo"), intervention.bound(item.hi, f"{f}.hi")
    acts = item.activations
    if acts is None:  # (head scaling: checked as an addition without values)
        scale = finite_number(item.scale, f"{f}.scale")
        three_d = item.position_indices is not None
        intervention.check_fields(op, phase, lo, hi, scale, bool(item.norm_match), False, three_d, f)
    if acts is None and heads is not None and op == "add":
        return _head_scaling(item, heads, f, shape, intervention.span(phase, prompt_len))
    if isinstance(acts, Mapping):
        acts = tensor_from_json(acts, f"{f}.activations", max_bytes=max_payload_bytes())
    if not isinstance(acts, torch.Tensor):
        raise ValueError(f"{f}.activations: expected a torch.Tensor, got {type(acts).__name__}")
    if not acts.is_floating_point():
        raise ValueError(f"{f}.activations: expected a floating-point tensor, got {acts.dtype}")
    layers = layer_list(item.layer_indices, f"{f}.layer_indices", shape.n_layers, unique=True)
    cols = None
    if heads is not None:  # one d_head vector for each listed head (or a full z row): zero elsewhere
        if acts.shape[-1] == shape.d_head:
            full = acts.new_zeros(*acts.shape[:-1], shape.n_heads, shape.d_head)
            full[..., heads, :] = acts.unsqueeze(-2)
        elif acts.shape[-1] == shape.n_heads * shape.d_head:  # a z row: only the listed heads' values are used
            full = acts.new_zeros(*acts.shape[:-1], shape.n_heads, shape.d_head)
            full[..., heads, :] = acts.unflatten(-1, (shape.n_heads, shape.d_head))[..., heads, :]
        else:
            raise ValueError(
                f"{f}.activations: last dimension {acts.shape[-1]} != d_head {shape.d_head} (or n_heads * d_head "
                f"{shape.n_heads * shape.d_head}) with heads"
            )
        acts = full.flatten(-2)
        cols = [h * shape.d_head + j for h in heads for j in range(shape.d_head)]
    if point == pts.Z and item.norm_match:
        raise ValueError(f"{f}.norm_match: not defined at point 'z' (per-head values); use it at a residual point")
    if acts.ndim not in (2, 3):
        raise ValueError(
            f"{f}.activations: expected 2-D (n_layers, d_model) or 3-D (n_layers, n_pos, d_model), "
            f"got shape {tuple(acts.shape)}"
        )
    if acts.shape[0] != len(layers):
        raise ValueError(f"{f}.activations: first dimension {acts.shape[0]} != len(layer_indices) {len(layers)}")
    width, width_name = (shape.d_mlp, "d_mlp") if point == pts.MLP_POST else (shape.d_model, "d_model")
    if acts.shape[-1] != width:
        raise ValueError(f"{f}.activations: last dimension {acts.shape[-1]} != {width_name} {width}")
    scale = finite_number(item.scale, f"{f}.scale")
    if not isinstance(item.norm_match, bool):
        raise ValueError(f"{f}.norm_match: expected a bool, got {item.norm_match!r}")
    intervention.check_fields(op, phase, lo, hi, scale, item.norm_match, True, acts.ndim == 3, f)
    # float32 rows, finite, unit rows for ablate / cap (with heads: the direction within those heads);
    # remembered by content: an input equal to a recent one skips the passes (`steer_rows`)
    acts, raw, digest, repeat = checked_rows(acts, op, f)
    positions = None
    if acts.ndim == 3:
        n_pos = acts.shape[1]
        positions = list(range(n_pos)) if item.position_indices is None else item.position_indices
        if isinstance(positions, torch.Tensor):
            positions = positions.tolist()
        if not isinstance(positions, (list, tuple)) or len(positions) != n_pos:
            raise ValueError(
                f"{f}.position_indices: expected {n_pos} positions (one per row of activations), got {positions!r}"
            )
        positions = list(positions)
        for p in positions:
            if isinstance(p, bool) or not isinstance(p, int) or p < 0:
                raise ValueError(f"{f}.position_indices: positions must be non-negative ints, got {p!r}")
            if p >= prompt_len:
                raise ValueError(f"{f}.position_indices: position {p} is past the prompt ({prompt_len} tokens)")
        if len(set(positions)) != len(positions):
            raise ValueError(f"{f}.position_indices: duplicate positions")
    elif item.position_indices is not None:
        raise ValueError(f"{f}.position_indices: only valid with 3-D activations")
    sites = pts.canonical_sites(point, layers)
    return Steer(
        sites,
        acts,
        positions,
        float(scale),
        item.norm_match,
        op=intervention.CODE[op],
        lo=lo,
        hi=hi,
        span=intervention.span(phase, prompt_len),
        cols=cols if op == "set" else None,
        raw=raw,
        digest=digest,
        repeat=repeat,
    )


STEER_FIELDS = {
    "activations",
    "layer_indices",
    "scale",
    "norm_match",
    "position_indices",
    "point",
    "heads",
    *("op", "phase", "lo", "hi"),
}


def _heads(value: Any, point: str, f: str, shape: ModelShape) -> list[int] | None:
    if value is None:
        return None
    if point != pts.Z:
        raise ValueError(f"{f}.heads: only with point='z' (per-head attention outputs), got point={point!r}")
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    heads = int_list(value, f"{f}.heads")
    if not heads or len(set(heads)) != len(heads):
        raise ValueError(f"{f}.heads: expected a non-empty list of distinct head indices, got {value!r}")
    for h in heads:
        if not 0 <= h < shape.n_heads:
            raise ValueError(f"{f}.heads: head {h} is out of range for {shape.n_heads} heads (0..{shape.n_heads - 1})")
    return heads


def _head_scaling(item: Any, heads: list[int], f: str, shape: ModelShape, span: tuple[int, int] | None) -> Steer:
    """`SteeringVector(None, layers, point="z", heads=[...], scale=s)`: those heads' outputs times `s`
    (0 ablates them) — a multiplication, so it has no vector, norm matching or positions."""
    if item.norm_match or item.position_indices is not None:
        raise ValueError(f"{f}: scaling heads (no activations) takes neither norm_match nor position_indices")
    layers = layer_list(item.layer_indices, f"{f}.layer_indices", shape.n_layers, unique=True)
    scale = finite_number(item.scale, f"{f}.scale")
    mul = torch.ones(len(layers), shape.n_heads, shape.d_head)
    mul[:, heads] = float(scale)
    sites = [pts.canonical_site(pts.Z, l) for l in layers]
    return Steer(sites, mul.flatten(-2), None, 1.0, False, mul=True, span=span)


HOOK_FIELDS = {"fn", "layer_indices", "pre", "point", "batched", "read_only"}


def hook_point(pre: Any, point: Any, f: str, shape: ModelShape) -> str:
    """`pre=True` is `point="resid_pre"`; both together must agree."""
    if not isinstance(pre, bool):
        raise ValueError(f"{f}.pre: expected a bool")
    if point is None:
        return pts.RESID_PRE if pre else pts.RESID_POST
    point = pts.point_name(point, f"{f}.point")
    if pre and point != pts.RESID_PRE:
        raise ValueError(f"{f}.point: pre=True means point='resid_pre', got point={point!r}")
    pts.check_available(point, f"{f}.point", shape.missing)
    return point


def _hook_item(item: Any, i: int, shape: ModelShape) -> HookSpec:
    f = f"{HOOK_KEY}[{i}]"
    if isinstance(item, Mapping):
        return _remote_hook_item(item, f, shape)
    if not isinstance(item, Hook):
        raise ValueError(f"{f}: expected a vllm_worker.Hook, got {type(item).__name__}")
    if not callable(item.fn):
        raise ValueError(f"{f}.fn: not callable")
    layers = layer_list(item.layer_indices, f"{f}.layer_indices", shape.n_layers, unique=True)
    point = hook_point(item.pre, item.point, f, shape)
    return HookSpec(pickle_hook(item.fn, f), layers, point, item.batched, item.read_only)


def _remote_hook_item(item: Mapping[str, Any], f: str, shape: ModelShape) -> HookSpec:
    """`{"fn": base64(cloudpickle), "layer_indices": [...], "pre": false}` — refused without opt-in. The
    original vllm-lens's `{"fn": {"cloudpickle": base64}}` is the same thing."""
    require_remote_hooks()
    unknown = set(item) - HOOK_FIELDS
    if unknown:
        name = sorted(unknown)[0]
        raise ValueError(f"{f}: unknown fields {sorted(unknown)}{pts.closest(name, HOOK_FIELDS)}")
    fn = item.get("fn")
    if isinstance(fn, Mapping) and set(fn) == {"cloudpickle"}:
        fn = fn["cloudpickle"]
    if not isinstance(fn, str):
        raise ValueError(f'{f}.fn: expected base64 of a cloudpickled function (or {{"cloudpickle": base64}})')
    try:
        raw = base64.b64decode(fn, validate=True)
    except Exception:
        raise ValueError(f"{f}.fn: not valid base64") from None
    layers = layer_list(item.get("layer_indices"), f"{f}.layer_indices", shape.n_layers, unique=True)
    point = hook_point(item.get("pre", False), item.get("point"), f, shape)
    flags = {k: item.get(k, False) for k in ("batched", "read_only")}
    for k, v in flags.items():
        if not isinstance(v, bool):
            raise ValueError(f"{f}.{k}: expected a bool")
    _check_loads(raw, f"{f}.fn")
    return HookSpec(raw, layers, point, flags["batched"], flags["read_only"])


def _check_loads(raw: bytes, field_name: str) -> None:
    """A hook the worker could not unpickle would fail inside the forward pass (and take the engine with
    it): load it here first. Only reached when the operator enabled remote hooks (it runs their code)."""
    import cloudpickle

    try:
        fn = cloudpickle.loads(raw)
    except Exception as e:
        raise ValueError(f"{field_name}: cannot be loaded on the server ({type(e).__name__}: {str(e)[:200]})") from None
    if not callable(fn):
        raise ValueError(f"{field_name}: not callable after loading ({type(fn).__name__})")


def pickle_hook(fn: Any, field_name: str) -> bytes:
    import cloudpickle

    try:
        return cloudpickle.dumps(fn)
    except Exception as e:
        raise ValueError(f"{field_name}.fn: cannot be serialized with cloudpickle: {e}") from None


def parse_hooks(items: Any, shape: ModelShape) -> list[HookSpec]:
    if isinstance(items, str):
        require_remote_hooks()  # before touching the payload
    items = from_json_string(items, HOOK_KEY)
    if isinstance(items, (Hook, Mapping)):
        items = [items]
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"{HOOK_KEY}: expected a list of Hook, got {type(items).__name__}")
    return [_hook_item(it, i, shape) for i, it in enumerate(items)]


def parse_request(
    extra_args: Mapping[str, Any],
    shape: ModelShape,
    prompt_len: int,
    saes: Mapping[str, Any] | None = None,
    probes: Mapping[str, Any] | None = None,
) -> RequestSpec | None:
    """Validate our keys in `extra_args`; `None` when the request uses no feature. `saes` / `probes`: the
    loaded SAEs / probes by name (`frontend/saes`, `frontend/probes`)."""
    ours = {k: v for k, v in extra_args.items() if isinstance(k, str) and k.startswith(NAMESPACE_PREFIXES)}
    if not ours:
        return None
    for k in ours:
        if k not in KNOWN_KEYS:
            raise ValueError(
                f"extra_args.{k}: unknown inspect-lens key{pts.closest(k, KNOWN_KEYS)} (known: {', '.join(KNOWN_KEYS)})"
            )
    spec = RequestSpec(key=os.urandom(16).hex())  # a random key, as uuid4().hex (without a UUID object)
    if ACTIVATIONS_KEY in ours:
        spec.points = capture_points(ours[ACTIVATIONS_KEY], shape)
    if CAPTURE_KEY in ours:
        layers = capture_layers(ours[CAPTURE_KEY], shape.n_layers)
        spec.points[pts.RESID_POST] = sorted(set(spec.points.get(pts.RESID_POST, [])) | set(layers))
    spec.capture = capture_sites(spec.points, shape.mlp_chunks)
    if STEER_KEY in ours:
        items = from_json_string(ours[STEER_KEY], STEER_KEY)
        if isinstance(items, (SteeringVector, Mapping)):
            items = [items]
        if not isinstance(items, (list, tuple)):
            raise ValueError(f"{STEER_KEY}: expected a list of SteeringVector, got {type(items).__name__}")
        spec.steers = [_steering_item(it, i, shape, prompt_len) for i, it in enumerate(items)]
        spec.steers = mlp_post.split_steers(spec.steers, shape, STEER_KEY)
    if HOOK_KEY in ours:
        spec.hooks = parse_hooks(ours[HOOK_KEY], shape)
    if any(k in ours for k in SAE_KEYS):
        sae_keys.parse(ours, spec, shape, saes or {})
    if ACTIONS_KEY in ours:
        action_keys.parse(ours[ACTIONS_KEY], spec, shape, prompt_len, _steering_item, probes)
    if any(k in ours for k in PROBE_KEYS):
        probe_keys.parse(ours, spec, probes or {})
    return spec
