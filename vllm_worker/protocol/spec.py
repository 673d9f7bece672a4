"""Per-request specs: read the caller's `extra_args`, validate them (a `ValueError` naming the field),
and turn them into a msgspec-safe payload the workers decode. Nothing here touches vLLM internals.
"""

from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Mapping

import torch

from vllm_worker import envs
from vllm_worker.api.hooks import Hook
from vllm_worker.api.steering import SteeringVector
from vllm_worker.envs import limit
from vllm_worker.protocol.checks import finite_number, int_list
from vllm_worker.protocol.wire import tensor_from_bytes, tensor_from_json, tensor_to_bytes

CAPTURE_KEY = "output_residual_stream"
STEER_KEY = "apply_steering_vectors"
HOOK_KEY = "apply_hooks"
PAYLOAD_KEY = "_inspect_lens"
KNOWN_KEYS = (CAPTURE_KEY, STEER_KEY, HOOK_KEY)
# Keys with these prefixes belong to us: a typo (`output_residual_streams`) is an error, not ignored.
NAMESPACE_PREFIXES = ("output_residual", "apply_steering", "apply_hook", "lens_", PAYLOAD_KEY)


# Largest structured payload accepted in one request (steering vectors, hooks), in bytes.
MAX_PAYLOAD_BYTES = limit("VLLM_LENS_MAX_PAYLOAD_MB")
REMOTE_HOOKS_ENV = "VLLM_LENS_ALLOW_REMOTE_HOOKS"


def remote_hooks_allowed() -> bool:
    """Hooks sent as bytes (over HTTP) run arbitrary code: only when the operator opted in."""
    return bool(envs.get(REMOTE_HOOKS_ENV))


def require_remote_hooks(field_name: str = HOOK_KEY) -> None:
    """The one opt-in rule for code from the network: `PermissionError` (HTTP 403) naming `field_name` unless
    the operator started the server with --allow-remote-hooks. Checked before anything is unpickled."""
    if not remote_hooks_allowed():
        raise PermissionError(
            f"{field_name}: hooks sent as bytes execute arbitrary code on the server and are disabled; "
            f"the operator must start the server with --allow-remote-hooks ({REMOTE_HOOKS_ENV}=1)"
        )


def _from_json_string(value: Any, field_name: str) -> Any:
    """Over HTTP, `vllm_xargs` values are flat: structured payloads arrive as JSON strings."""
    if not isinstance(value, str):
        return value
    if len(value) > MAX_PAYLOAD_BYTES * 4 // 3 + 1024:
        raise ValueError(
            f"{field_name}: payload exceeds the limit of {MAX_PAYLOAD_BYTES} bytes (VLLM_LENS_MAX_PAYLOAD_MB)"
        )
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{field_name}: not valid JSON ({e.msg} at position {e.pos})") from None


@dataclass
class ModelShape:
    n_layers: int
    d_model: int


@dataclass
class Steer:
    layers: list[int]
    vectors: torch.Tensor  # (n_layers, d) or (n_layers, n_pos, d)
    positions: list[int] | None
    scale: float
    norm_match: bool


@dataclass
class HookSpec:
    fn: bytes  # cloudpickle of the callable (the caller's own code, in-process or opted-in remote)
    layers: list[int]
    pre: bool


@dataclass
class RequestSpec:
    """What the worker does for one request (decoded form)."""

    key: str
    capture: list[int] = field(default_factory=list)
    steers: list[Steer] = field(default_factory=list)
    hooks: list[HookSpec] = field(default_factory=list)

    @property
    def wants_results(self) -> bool:
        return bool(self.capture or self.hooks)


def has_lens_keys(extra_args: Mapping[str, Any] | None) -> bool:
    return bool(extra_args) and any(isinstance(k, str) and k.startswith(NAMESPACE_PREFIXES) for k in extra_args or ())


def layer_list(value: Any, field_name: str, n_layers: int, unique: bool = False) -> list[int]:
    if isinstance(value, (int,)) and not isinstance(value, bool):
        value = [value]
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, range):
        value = list(value)
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{field_name}: expected a non-empty list of layer indices, got {value!r}")
    out = []
    for v in int_list(value, field_name, "layer indices"):
        if not -n_layers <= v < n_layers:
            raise ValueError(
                f"{field_name}: layer {v} is out of range for a model with {n_layers} layers "
                f"(valid: {-n_layers}..{n_layers - 1})"
            )
        out.append(v % n_layers)
    if unique and len(set(out)) != len(out):
        raise ValueError(f"{field_name}: duplicate layers {list(value)}")
    return out


ALL_LAYERS = "all"


def capture_layers(value: Any, n_layers: int) -> list[int]:
    """`output_residual_stream`: a list of layer indices, `True` or `"all"` (every layer), or a JSON string
    of a list (`"[15, 20]"`, the form flat `vllm_xargs` force over HTTP). Sorted, without duplicates."""
    if value is True or value == ALL_LAYERS:
        return list(range(n_layers))
    if isinstance(value, str):
        parsed = _from_json_string(value, CAPTURE_KEY)
        if not isinstance(parsed, list):
            raise ValueError(f'{CAPTURE_KEY}: expected a list of layer indices, true or "all", got {value!r}')
        value = parsed
    return sorted(set(layer_list(value, CAPTURE_KEY, n_layers)))


def _steering_item(item: Any, i: int, shape: ModelShape, prompt_len: int) -> Steer:
    f = f"{STEER_KEY}[{i}]"
    if isinstance(item, Mapping):
        unknown = set(item) - {"activations", "layer_indices", "scale", "norm_match", "position_indices"}
        if unknown:
            raise ValueError(f"{f}: unknown fields {sorted(unknown)}")
        if "activations" not in item or "layer_indices" not in item:
            raise ValueError(f"{f}: needs 'activations' and 'layer_indices'")
        # checked field by field below, with messages naming the request's field (not as a model)
        item = SimpleNamespace(
            activations=item["activations"],
            layer_indices=item["layer_indices"],
            scale=item.get("scale", 1.0),
            norm_match=item.get("norm_match", False),
            position_indices=item.get("position_indices"),
        )
    elif not isinstance(item, SteeringVector):
        raise ValueError(f"{f}: expected a SteeringVector, got {type(item).__name__}")
    acts = item.activations
    if isinstance(acts, Mapping):
        acts = tensor_from_json(acts, f"{f}.activations", max_bytes=MAX_PAYLOAD_BYTES)
    if not isinstance(acts, torch.Tensor):
        raise ValueError(f"{f}.activations: expected a torch.Tensor, got {type(acts).__name__}")
    if not acts.is_floating_point():
        raise ValueError(f"{f}.activations: expected a floating-point tensor, got {acts.dtype}")
    layers = layer_list(item.layer_indices, f"{f}.layer_indices", shape.n_layers, unique=True)
    if acts.ndim not in (2, 3):
        raise ValueError(
            f"{f}.activations: expected 2-D (n_layers, d_model) or 3-D (n_layers, n_pos, d_model), "
            f"got shape {tuple(acts.shape)}"
        )
    if acts.shape[0] != len(layers):
        raise ValueError(f"{f}.activations: first dimension {acts.shape[0]} != len(layer_indices) {len(layers)}")
    if acts.shape[-1] != shape.d_model:
        raise ValueError(f"{f}.activations: last dimension {acts.shape[-1]} != d_model {shape.d_model}")
    acts = acts.detach().to("cpu", torch.float32).clone()
    if not torch.isfinite(acts).all():
        raise ValueError(f"{f}.activations: contains NaN or inf")
    scale = finite_number(item.scale, f"{f}.scale")
    if not isinstance(item.norm_match, bool):
        raise ValueError(f"{f}.norm_match: expected a bool, got {item.norm_match!r}")
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
    return Steer(layers, acts, positions, float(scale), item.norm_match)


def _hook_item(item: Any, i: int, shape: ModelShape) -> HookSpec:
    f = f"{HOOK_KEY}[{i}]"
    if isinstance(item, Mapping):
        return _remote_hook_item(item, f, shape)
    if not isinstance(item, Hook):
        raise ValueError(f"{f}: expected a vllm_worker.Hook, got {type(item).__name__}")
    if not callable(item.fn):
        raise ValueError(f"{f}.fn: not callable")
    layers = layer_list(item.layer_indices, f"{f}.layer_indices", shape.n_layers, unique=True)
    if not isinstance(item.pre, bool):
        raise ValueError(f"{f}.pre: expected a bool")
    return HookSpec(pickle_hook(item.fn, f), layers, item.pre)


def _remote_hook_item(item: Mapping[str, Any], f: str, shape: ModelShape) -> HookSpec:
    """`{"fn": base64(cloudpickle), "layer_indices": [...], "pre": false}` — refused without opt-in. The
    original vllm-lens's `{"fn": {"cloudpickle": base64}}` is the same thing."""
    require_remote_hooks()
    unknown = set(item) - {"fn", "layer_indices", "pre"}
    if unknown:
        raise ValueError(f"{f}: unknown fields {sorted(unknown)}")
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
    pre = item.get("pre", False)
    if not isinstance(pre, bool):
        raise ValueError(f"{f}.pre: expected a bool")
    _check_loads(raw, f"{f}.fn")
    return HookSpec(raw, layers, pre)


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
    items = _from_json_string(items, HOOK_KEY)
    if isinstance(items, (Hook, Mapping)):
        items = [items]
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"{HOOK_KEY}: expected a list of Hook, got {type(items).__name__}")
    return [_hook_item(it, i, shape) for i, it in enumerate(items)]


def parse_request(extra_args: Mapping[str, Any], shape: ModelShape, prompt_len: int) -> RequestSpec | None:
    """Validate our keys in `extra_args`; `None` when the request uses no feature."""
    ours = {k: v for k, v in extra_args.items() if isinstance(k, str) and k.startswith(NAMESPACE_PREFIXES)}
    if not ours:
        return None
    for k in ours:
        if k not in KNOWN_KEYS:
            raise ValueError(f"extra_args.{k}: unknown inspect-lens key (known: {', '.join(KNOWN_KEYS)})")
    spec = RequestSpec(key=uuid.uuid4().hex)
    if CAPTURE_KEY in ours:
        spec.capture = capture_layers(ours[CAPTURE_KEY], shape.n_layers)
    if STEER_KEY in ours:
        items = _from_json_string(ours[STEER_KEY], STEER_KEY)
        if isinstance(items, (SteeringVector, Mapping)):
            items = [items]
        if not isinstance(items, (list, tuple)):
            raise ValueError(f"{STEER_KEY}: expected a list of SteeringVector, got {type(items).__name__}")
        spec.steers = [_steering_item(it, i, shape, prompt_len) for i, it in enumerate(items)]
    if HOOK_KEY in ours:
        spec.hooks = parse_hooks(ours[HOOK_KEY], shape)
    return spec


def encode(spec: RequestSpec) -> dict[str, Any]:
    """msgspec-safe payload for the engine core and workers (no pickle, no tensors)."""
    return {
        "v": 1,
        "key": spec.key,
        "capture": spec.capture,
        "steer": [
            {
                "layers": s.layers,
                "vec": tensor_to_bytes(s.vectors),
                "positions": s.positions,
                "scale": s.scale,
                "norm_match": s.norm_match,
            }
            for s in spec.steers
        ],
        "hooks": [{"fn": h.fn, "layers": h.layers, "pre": h.pre} for h in spec.hooks],
    }


def decode(payload: Mapping[str, Any]) -> RequestSpec:
    if payload.get("v") != 1:
        raise ValueError(f"{PAYLOAD_KEY}: unsupported payload version {payload.get('v')!r}")
    return RequestSpec(
        key=payload["key"],
        capture=list(payload.get("capture") or []),
        steers=[
            Steer(
                list(s["layers"]),
                tensor_from_bytes(s["vec"], "steer.vec"),
                None if s.get("positions") is None else list(s["positions"]),
                float(s["scale"]),
                bool(s["norm_match"]),
            )
            for s in payload.get("steer") or []
        ],
        hooks=[HookSpec(bytes(h["fn"]), list(h["layers"]), bool(h["pre"])) for h in payload.get("hooks") or []],
    )


def cache_salt(spec: RequestSpec) -> str | None:
    """A prefix-cache salt for requests that change the forward pass: KV computed under steering is
    shared only with identically steered requests; KV computed under hooks (arbitrary code) never."""
    if spec.hooks:
        return "inspect-lens-hooks:" + spec.key
    if not spec.steers:
        return None
    import hashlib

    h = hashlib.sha256()
    for s in spec.steers:
        h.update(repr((s.layers, s.positions, s.scale, s.norm_match, tuple(s.vectors.shape))).encode())
        h.update(s.vectors.numpy().tobytes())
    return "inspect-lens:" + h.hexdigest()
