"""The request protocol: our keys in `extra_args`, the limits on them, and the payload that carries a
validated request (`RequestSpec`) from the frontend to the workers — msgspec-safe (no pickle, tensors as
bytes), encoded in the frontend (`frontend/validation` checks what callers send), decoded in the workers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from vllm_worker import envs
from vllm_worker.protocol import points as pts
from vllm_worker.protocol.checks import int_list
from vllm_worker.protocol.wire import tensor_from_bytes, tensor_to_bytes

CAPTURE_KEY = "output_residual_stream"  # shorthand for {"resid_post": layers} of ACTIVATIONS_KEY
ACTIVATIONS_KEY = "output_activations"  # {point: layers}
STEER_KEY = "apply_steering_vectors"
HOOK_KEY = "apply_hooks"
PAYLOAD_KEY = "_inspect_lens"
# sparse autoencoders loaded with `llm.load_sae` / `POST /v1/lens/saes` (docs/saes.md)
SAE_FEATURES_KEY = "output_sae_features"  # {"sae": name, "top_k": k} or {"sae": name, "features": [ids]}
SAE_STEER_KEY = "apply_sae_steering"  # [{"sae": name, "features": [ids], "scale": s}]: + s * W_dec[f]
SAE_CLAMP_KEY = "apply_sae_clamp"  # [{"sae": name, "features": [ids], "values": v}]: f set to v
SAE_KEYS = (SAE_FEATURES_KEY, SAE_STEER_KEY, SAE_CLAMP_KEY)
# act on a probe's score in the same generation (docs/probes.md, "Acting on a score")
ACTIONS_KEY = "probe_actions"
VECTOR_DROPS_KEY = "drop_vectors"  # in a payload: registered vectors the workers may forget (`frontend.vector_refs`)
VECTOR_REFS_KEY = "vec_refs"  # in a payload: how many of its steers name a registered vector by reference
# linear probes loaded with `llm.load_probe` / `POST /v1/lens/probes` (docs/probes.md)
PROBE_SCORES_KEY = "output_probe_scores"  # [names] or {name: {"aggregate": [...], "positions": ...}}
PROBE_KEYS = (PROBE_SCORES_KEY,)
KNOWN_KEYS = (CAPTURE_KEY, ACTIVATIONS_KEY, STEER_KEY, HOOK_KEY, *SAE_KEYS, *PROBE_KEYS, ACTIONS_KEY)
# Keys with these prefixes belong to us: a typo (`output_residual_streams`) is an error, not ignored.
NAMESPACE_PREFIXES = (
    "output_residual",
    "output_activation",
    "apply_steering",
    "apply_hook",
    "output_sae",
    "apply_sae",
    ACTIONS_KEY,
    "output_probe",
    "lens_",
    PAYLOAD_KEY,
)


def max_payload_bytes() -> int:
    """Largest structured payload accepted in one request (steering vectors, hooks), in bytes."""
    return envs.limit("VLLM_LENS_MAX_PAYLOAD_MB")


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


def from_json_string(value: Any, field_name: str) -> Any:
    """Over HTTP, `vllm_xargs` values are flat: structured payloads arrive as JSON strings."""
    if not isinstance(value, str):
        return value
    cap = max_payload_bytes()
    if len(value) > cap * 4 // 3 + 1024:
        raise ValueError(f"{field_name}: payload exceeds the limit of {cap} bytes (VLLM_LENS_MAX_PAYLOAD_MB)")
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{field_name}: not valid JSON ({e.msg} at position {e.pos})") from None


@dataclass
class ModelShape:
    n_layers: int
    d_model: int
    missing: dict[str, str] = field(default_factory=dict)  # hook point the model lacks -> why
    n_heads: int = 0
    d_head: int = 0
    n_experts: int = 0  # MoE models
    top_k: int = 0  # experts chosen per token
    n_kv_heads: int = 0
    d_mlp: int = 0  # the dense MLP's hidden width (mlp_post)

    @property
    def mlp_chunks(self) -> int:
        return pts.mlp_chunks(self.d_mlp, self.d_model)


@dataclass
class Steer:
    layers: list[int]  # tap sites (`points.canonical_site` of the point and the caller's layers)
    vectors: torch.Tensor  # (n_layers, d) or (n_layers, n_pos, d)
    positions: list[int] | None
    scale: float
    norm_match: bool
    mul: bool = False  # `vectors` multiply the stream there instead of adding to it (head scaling at z)
    gate: int = -1  # >= 0: applied only once action `gate` of the request has fired (`probe_actions`)
    op: int = 0  # `protocol.ops` code: add, ablate (unit rows), cap (unit rows, lo / hi), set
    lo: float | None = None  # cap's range (None: unbounded on that side)
    hi: float | None = None
    span: tuple[int, int] | None = None  # absolute positions it applies to (its phase); None: all
    cols: list[int] | None = None  # set: the elements written (heads at z); None: all
    # made by the frontend's validation (`frontend.steer_rows`), None elsewhere: `vectors`' bytes (what
    # `encode` sends: shared by requests of equal content) and their SHA-256 (what `cache_salt` hashes)
    raw: bytes | None = field(default=None, repr=False, compare=False)
    digest: bytes | None = field(default=None, repr=False, compare=False)
    # > 0: `raw` is the first row along dim 0 only, every row being equal to it (one row a layer crosses)
    repeat: int = field(default=0, repr=False, compare=False)

    @property
    def plain(self) -> bool:
        """Today's steering: an addition at every position of its phase-less rows."""
        return self.op == 0 and self.span is None


@dataclass
class HookSpec:
    fn: bytes  # cloudpickle of the callable (the caller's own code, in-process or opted-in remote)
    layers: list[int]  # the caller's layer indices (each worker maps them to its sites: `plan.hook_at`)
    point: str = pts.RESID_POST
    batched: bool = False  # one call for all requests of a step carrying the same hook (api.hooks)
    read_only: bool = False  # returns None: may run after the forward, on a snapshot (api.hooks)

    def rpc(self) -> tuple[bytes, list[int], str, bool, bool]:
        """What `lens_register_hooks` takes (persistent hooks)."""
        return (self.fn, self.layers, self.point, self.batched, self.read_only)


@dataclass
class RequestSpec:
    """What the worker does for one request (decoded form)."""

    key: str
    capture: list[int] = field(default_factory=list)  # tap sites, sorted
    # what the caller asked to capture, {point: layers} (frontend only: how results are handed back)
    points: dict[str, list[int]] = field(default_factory=dict)
    steers: list[Steer] = field(default_factory=list)
    hooks: list[HookSpec] = field(default_factory=list)
    # SAE work in the workers, msgspec-safe dicts (`frontend/saes.parse`): {"sae", "site", "uid"} and
    # "top_k" or "ids" (features returned) or "ids" + "values" with "clamp": true
    sae: list[dict[str, Any]] = field(default_factory=list)
    # `probe_actions`, msgspec-safe dicts (`frontend/actions.parse`): the condition (site, weight bytes,
    # bias), threshold, aggregate and what firing does; their steering is in `steers` with `gate` set
    actions: list[dict[str, Any]] = field(default_factory=list)
    # probes scored in the workers, msgspec-safe dicts (`frontend/probes.parse`): {"probe", "uid"}
    probes: list[dict[str, Any]] = field(default_factory=list)
    # what the frontend makes of the scores (frontend only): {probe: {"aggregate": [...], "positions": ...}}
    probe_outputs: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def wants_results(self) -> bool:
        return bool(
            self.capture or self.hooks or self.probes or self.actions or any(not u.get("clamp") for u in self.sae)
        )


def has_lens_keys(extra_args: Mapping[str, Any] | None) -> bool:
    return bool(extra_args) and any(isinstance(k, str) and k.startswith(NAMESPACE_PREFIXES) for k in extra_args or ())


_INTS = {int}


def layer_list(value: Any, field_name: str, n_layers: int, unique: bool = False) -> list[int]:
    if isinstance(value, (int,)) and not isinstance(value, bool):
        value = [value]
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, range):
        value = list(value)
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{field_name}: expected a non-empty list of layer indices, got {value!r}")
    if set(map(type, value)) == _INTS and 0 <= min(value) and max(value) < n_layers:
        out = list(value)  # (plain ints in range, as `% n_layers` leaves them: the loop below, in C)
        if unique and len(set(out)) != len(out):
            raise ValueError(f"{field_name}: duplicate layers {list(value)}")
        return out
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
        parsed = from_json_string(value, CAPTURE_KEY)
        if not isinstance(parsed, list):
            raise ValueError(f'{CAPTURE_KEY}: expected a list of layer indices, true or "all", got {value!r}')
        value = parsed
    return sorted(set(layer_list(value, CAPTURE_KEY, n_layers)))


def capture_points(value: Any, shape: ModelShape) -> dict[str, list[int]]:
    """`output_activations`: `{point: layers}` (layers as for `output_residual_stream`), or its JSON string."""
    value = from_json_string(value, ACTIVATIONS_KEY)
    if not isinstance(value, Mapping) or not value:
        raise ValueError(
            f'{ACTIVATIONS_KEY}: expected {{point: layer indices}}, e.g. {{"attn_out": [3, 7]}}, got {value!r}'
        )
    out = {}
    for point, layers in value.items():
        f = f"{ACTIVATIONS_KEY}.{point}"
        pts.point_name(point, f)
        pts.check_available(point, f, shape.missing)
        if layers is True or layers == ALL_LAYERS:
            out[point] = list(range(shape.n_layers))
        else:
            out[point] = sorted(set(layer_list(layers, f, shape.n_layers)))
    return out


def capture_sites(points: Mapping[str, list[int]], mlp_chunks: int = 1) -> list[int]:
    return sorted({s for p, ls in points.items() for l in ls for s in pts.point_sites(p, l, mlp_chunks)})


def encode(spec: RequestSpec) -> dict[str, Any]:
    """msgspec-safe payload for the engine core and workers (no pickle, no tensors). Steering, hooks and
    SAE work are left out when there are none (a capture-only request: one dict and its capture list)."""
    payload: dict[str, Any] = {"v": 1, "key": spec.key, "capture": spec.capture}
    if spec.steers:
        payload["steer"] = [
            {
                "layers": s.layers,
                "vec": _wire(s),
                "positions": s.positions,
                "scale": s.scale,
                "norm_match": s.norm_match,
                "mul": s.mul,
                **({"gate": s.gate} if s.gate >= 0 else {}),
                **({} if s.plain else {"op": s.op, "lo": s.lo, "hi": s.hi, "span": s.span, "cols": s.cols}),
            }
            for s in spec.steers
        ]
    if spec.hooks:
        payload["hooks"] = [
            {"fn": h.fn, "layers": h.layers, "point": h.point, "batched": h.batched, "read_only": h.read_only}
            for h in spec.hooks
        ]
    if spec.sae:
        payload["sae"] = spec.sae
    if spec.actions:
        payload["actions"] = spec.actions
    if spec.probes:
        payload["probes"] = spec.probes
    return payload


def decode(payload: Mapping[str, Any], view: bool = False) -> RequestSpec:
    """The payload `encode` made; `view`: steering vectors read the payload's bytes (`wire.tensor_from_bytes`:
    never written, copied where kept)."""
    if payload.get("v") != 1:
        raise ValueError(f"{PAYLOAD_KEY}: unsupported payload version {payload.get('v')!r}")
    capture = list(payload.get("capture") or ())
    steer, hooks, sae = payload.get("steer"), payload.get("hooks"), payload.get("sae")
    probes, actions = payload.get("probes"), payload.get("actions")
    if not (steer or hooks or sae or probes or actions):  # a capture-only request (most of them)
        return RequestSpec(payload["key"], capture)
    return RequestSpec(
        key=payload["key"],
        capture=capture,
        steers=[
            Steer(
                list(s["layers"]),
                _rows(s["vec"], view, len(s["layers"])),
                None if s.get("positions") is None else list(s["positions"]),
                float(s["scale"]),
                bool(s["norm_match"]),
                bool(s.get("mul", False)),
                int(s.get("gate", -1)),
                int(s.get("op", 0)),
                None if s.get("lo") is None else float(s["lo"]),
                None if s.get("hi") is None else float(s["hi"]),
                None if s.get("span") is None else (int(s["span"][0]), int(s["span"][1])),
                None if s.get("cols") is None else list(s["cols"]),
            )
            for s in steer or ()
        ],
        hooks=[
            HookSpec(
                bytes(h["fn"]),
                list(h["layers"]),
                str(h["point"]),
                bool(h.get("batched", False)),
                bool(h.get("read_only", False)),
            )
            for h in hooks or ()
        ],
        sae=[dict(u) for u in sae or ()],
        actions=[dict(a) for a in actions or ()],
        probes=[dict(u) for u in probes or ()],
    )


def cache_salt(spec: RequestSpec) -> str | None:
    """A prefix-cache salt for requests that change the forward pass: KV computed under steering is
    shared only with identically steered requests; KV computed under hooks (arbitrary code) never."""
    if spec.hooks:
        return "inspect-lens-hooks:" + spec.key
    clamps = [u for u in spec.sae if u.get("clamp")]
    if not spec.steers and not clamps:
        return None
    import hashlib

    h = hashlib.sha256()
    for u in clamps:  # the SAE's identity (`uid`: its file), its site, the features and values
        h.update(repr((u["uid"], u["site"], u["ids"], u["values"])).encode())
    for s in spec.steers:
        h.update(repr((s.layers, s.positions, s.scale, s.norm_match, s.mul, s.gate, tuple(s.vectors.shape))).encode())
        if not s.plain:  # (plain steering keeps the salts it always had)
            h.update(repr((s.op, s.lo, s.hi, s.span, s.cols)).encode())
        # the rows' own digest (the same for the same bytes), not their bytes: one hash per content
        h.update(s.digest if s.digest is not None else hashlib.sha256(s.vectors.numpy().tobytes()).digest())
    return "inspect-lens:" + h.hexdigest()


def _wire(s: Steer) -> dict[str, Any]:
    """The steer's rows as sent: `wire.tensor_to_bytes(vectors)`, with the bytes `raw` already holds; rows
    all equal (`repeat`, one per layer) as the one row and the count (`_rows` rebuilds them)."""
    vectors, raw, repeat = s.vectors, s.raw, s.repeat
    if raw is None:
        return tensor_to_bytes(vectors)
    if repeat and (repeat != vectors.shape[0] or repeat != len(s.layers)):  # (a steer remade without them)
        raise AssertionError(f"steering rows {tuple(vectors.shape)} are not {repeat} rows, one a layer")
    if vectors.dtype != torch.float32 or len(raw) * max(repeat, 1) != vectors.numel() * 4:
        raise AssertionError(f"steering rows {tuple(vectors.shape)} do not match their {len(raw)} wire bytes")
    out: dict[str, Any] = {"dtype": "float32", "shape": list(vectors.shape), "data": raw}
    if repeat:
        out["repeat"] = repeat
    return out


def _rows(vec: Any, view: bool, n_layers: int) -> torch.Tensor:
    """A steer's rows from `_wire`'s form. Repeated: the one row, expanded over dim 0 where `view` (never
    written) or copied into dense rows; the count must be the rows' first dimension and the steer's layers
    (anything else is refused naming the field, never broadcast)."""
    repeat = vec.get("repeat") if isinstance(vec, dict) else None
    if repeat is None:
        return tensor_from_bytes(vec, "steer.vec", view)
    shape = vec.get("shape")
    if (
        isinstance(repeat, bool)
        or not isinstance(repeat, int)
        or repeat < 1
        or not isinstance(shape, (list, tuple))
        or len(shape) < 2
        or shape[0] != repeat
        or repeat != n_layers
    ):
        raise ValueError(f"steer.vec.repeat: {repeat!r} does not match rows of shape {shape!r} at {n_layers} layers")
    row = tensor_from_bytes({**vec, "shape": list(shape[1:])}, "steer.vec", view)  # (its size checked there)
    rows = row.unsqueeze(0).expand(repeat, *row.shape)
    return rows if view else rows.contiguous()
