"""Named vectors: tensors registered once on an engine (offline `llm.register_vector`, HTTP
`POST /v1/lens/vectors`) that steering entries name instead of carrying (`{"name": "happy",
"layer_indices": [15], "scale": 4}` / `SteeringVector(name="happy", ...)`), so a request or an eval log
carries a name, not megabytes.

A name is resolved here, in the frontend, when the request is admitted: the entry gets the stored tensor
and is validated exactly like an inline vector, so steering by name gives the numbers of steering with the
same tensor inline. Where the workers hold the registration (`frontend.vector_refs`) the rows then travel
as its id instead of bytes; each registration has its own id, so replacing a name never changes what a
request in flight named.

Names live in scopes: offline and on a server without API keys there is one (""); on a server started
with `--api-key`, each key has its own, so callers sharing a server never see or use each other's
vectors. The HTTP middleware tells the frontend a request's scope through `SCOPE_KEY` in its
`vllm_xargs`, as a keyed hash of its API key that only this process can compute (a caller cannot name
another key's scope); it removes any such key a caller sent.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from vllm_worker import envs
from vllm_worker.api.steering import SteeringVector
from vllm_worker.frontend.state import engine_state
from vllm_worker.protocol.checks import all_finite, unknown_vector, vector_name
from vllm_worker.protocol.spec import ACTIONS_KEY, STEER_KEY, ModelShape, from_json_string
from vllm_worker.protocol.wire import dtype_name

SCOPE_KEY = "lens_vector_scope"  # in extra_args: the request's scope (set by the HTTP middleware only)
LIMIT = "VLLM_LENS_MAX_VECTORS_MB"
_SECRET = secrets.token_bytes(32)  # per process: scope tokens cannot be made outside it


def scope_token(api_key: str | None) -> str:
    """The scope of callers presenting `api_key` ("" for none)."""
    if not api_key:
        return ""
    return hmac.new(_SECRET, api_key.encode(), hashlib.sha256).hexdigest()[:32]


def check_name(name: Any, field: str = "name") -> str:
    return vector_name(name, field)


def check_vector(t: Any, shape: ModelShape, field: str = "activations") -> torch.Tensor:
    """A vector as registered: a finite floating-point tensor of 1-3 dimensions whose last one is d_model
    (or d_head, for steering chosen heads at `z`). Which layers, positions and point it goes to is said
    by each steering entry that names it. A detached CPU copy: the caller's tensor is never kept."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{field}: expected a tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"{field}: expected a floating-point tensor, got {t.dtype}")
    if t.ndim not in (1, 2, 3):
        raise ValueError(
            f"{field}: expected (d_model,), (n_layers, d_model) or (n_layers, n_pos, d_model), got shape "
            f"{tuple(t.shape)}"
        )
    widths = {shape.d_model} | ({shape.d_head} if shape.d_head else set()) | ({shape.d_mlp} if shape.d_mlp else set())
    if t.shape[-1] not in widths:
        raise ValueError(
            f"{field}: last dimension {t.shape[-1]} != d_model {shape.d_model}"
            + (f" (or d_head {shape.d_head} for heads at 'z')" if shape.d_head else "")
        )
    if t.numel() == 0:
        raise ValueError(f"{field}: empty tensor, shape {tuple(t.shape)}")
    t = t.detach().to("cpu").clone()
    if not all_finite(t):
        raise ValueError(f"{field}: contains NaN or inf")
    return t


@dataclass(frozen=True)
class Entry:
    tensor: torch.Tensor
    # this registration's id on the workers (a new one per register: a replaced name's requests in flight
    # keep theirs) and the rows pushed there under it (`frontend.vector_refs`; None: not pushed, requests
    # naming it carry the bytes)
    vid: str = field(default_factory=lambda: secrets.token_hex(8))
    held: Any = field(default=None, compare=False)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class VectorRegistry:
    """scope -> name -> tensor, bounded in total by VLLM_LENS_MAX_VECTORS_MB (every scope together: it is
    the server's memory). Registering a name again replaces it."""

    def __init__(self) -> None:
        self._scopes: dict[str, dict[str, Entry]] = {}
        self.nbytes = 0
        self._lock = threading.Lock()
        # registrations the workers hold: vid -> requests in flight naming it by reference; a replaced or
        # deleted one is retired, and dropped on the workers only once no request in flight names it
        self._pins: dict[str, int] = {}
        self._retired: dict[str, int] = {}  # vid -> bytes still counted (held for requests in flight)
        self._drops: list[str] = []
        self._unconfirmed: list[str] = []  # drops sent only with requests' payloads so far

    def register(self, scope: str, name: str, tensor: torch.Tensor) -> dict[str, Any]:
        entry = Entry(tensor)
        with self._lock:
            names = self._scopes.setdefault(scope, {})
            old = names.get(name)
            total = self.nbytes - (old.nbytes if old is not None and not self._pinned(old) else 0) + entry.nbytes
            cap = envs.limit(LIMIT)
            if total > cap:
                raise ValueError(
                    f"activations: registering {name!r} ({_size(entry.nbytes)}) would bring the engine's "
                    f"named vectors to {_size(total)}, above the limit of {_size(cap)} ({LIMIT}); delete "
                    "vectors that are no longer needed (a replaced or deleted one counts until the requests "
                    "in flight that named it have finished)"
                )
            names[name] = entry
            if old is not None:
                self._let_go(old)
            self.nbytes += entry.nbytes
        return describe(name, entry)

    def entry(self, scope: str, name: str, field: str) -> Entry:
        entry = self._scopes.get(scope, {}).get(name)
        if entry is None:
            raise unknown_vector(field, name, sorted(self._scopes.get(scope, {})))
        return entry

    def held(self, entry: Entry, forms: Any) -> None:
        """`entry`'s rows are on every worker now (`forms`: what `vector_refs` pushed), unless it was
        replaced or deleted meanwhile (then it is dropped there with the next message)."""
        with self._lock:
            object.__setattr__(entry, "held", forms)
            self._pins[entry.vid] = 0
            if all(e is not entry for names in self._scopes.values() for e in names.values()):
                self._retire(entry)

    def pin(self, vids: list[str]) -> bool:
        """A request about to name these registrations by reference: False (it carries the bytes) when one
        is no longer held; else each counts the request until `unpin`."""
        with self._lock:
            if any(v not in self._pins for v in vids):
                return False
            for v in vids:
                self._pins[v] += 1
            return True

    def unpin(self, vids: tuple[str, ...]) -> None:
        with self._lock:
            for v in vids:
                self._pins[v] -= 1
                if self._pins[v] == 0 and v in self._retired:
                    self._drop(v)

    def take_drops(self) -> list[str]:
        """Registrations the workers may forget now, for the next request's payload. That request may never
        reach the workers (aborted while queued), so they also go with every push until one succeeds
        (`push_drops`): the workers hold at most what was dropped since the last registration."""
        with self._lock:
            out, self._drops = self._drops, []
            self._unconfirmed.extend(out)
            return out

    def push_drops(self) -> list[str]:
        """Every drop not yet sent with a push (forgetting twice is harmless); `pushed` them after success."""
        with self._lock:
            out, self._drops = self._unconfirmed + self._drops, []
            self._unconfirmed = list(out)
            return out

    def pushed(self, drops: list[str]) -> None:
        with self._lock:
            done = set(drops)
            self._unconfirmed = [v for v in self._unconfirmed if v not in done]

    def _pinned(self, entry: Entry) -> bool:
        return self._pins.get(entry.vid, 0) > 0

    def _let_go(self, entry: Entry) -> None:
        """A replaced or deleted registration: its bytes stop counting now, or, while requests in flight name
        it by reference (the workers keep it for them), when the last of them finishes (`_drop`)."""
        if self._pinned(entry):
            self._retired[entry.vid] = entry.nbytes
        else:
            self.nbytes -= entry.nbytes
        self._retire(entry)

    def _retire(self, entry: Entry) -> None:
        if entry.vid not in self._pins:
            return
        self._retired.setdefault(entry.vid, 0)
        if self._pins[entry.vid] == 0:
            self._drop(entry.vid)

    def _drop(self, vid: str) -> None:
        self.nbytes -= self._retired.pop(vid, 0)
        del self._pins[vid]
        self._drops.append(vid)

    def get(self, scope: str, name: str, field: str) -> torch.Tensor:
        return self.entry(scope, name, field).tensor

    def list(self, scope: str) -> list[dict[str, Any]]:
        return [describe(n, e) for n, e in sorted(self._scopes.get(scope, {}).items())]

    def delete(self, scope: str, name: str) -> bool:
        with self._lock:
            entry = self._scopes.get(scope, {}).pop(name, None)
            if entry is None:
                return False
            self._let_go(entry)
            return True


def _size(n: int) -> str:
    return f"{n} bytes" if n < 1 << 20 else f"{n / 2**20:.2f} MiB"


def describe(name: str, entry: Entry) -> dict[str, Any]:
    t = entry.tensor
    return {"name": name, "shape": list(t.shape), "dtype": dtype_name(t.dtype), "bytes": entry.nbytes}


def registry_of(obj: Any) -> VectorRegistry:
    """The registry of the engine behind `obj` (anything `frontend.state.engine_state` takes)."""
    state = engine_state(obj)
    if state.vectors is None:
        state.vectors = VectorRegistry()
    return state.vectors


def _resolve_item(
    item: Any, i: int | str, registry: VectorRegistry | None, scope: str, used: list[Entry] | None = None
) -> Any:
    """A steering entry naming a vector -> the same entry carrying its tensor (new objects: the caller's
    are never edited). A 1-D vector is used at every listed layer. `i`: its index in the steering list,
    or its field's full name."""
    f = i if isinstance(i, str) else f"{STEER_KEY}[{i}]"
    if isinstance(item, SteeringVector):
        name = item.name
    elif isinstance(item, Mapping):
        name = item.get("name")
        if name is None:  # `SteeringVector.model_dump()` of an inline vector says name=None
            return {k: v for k, v in item.items() if k != "name"}
    else:
        return item
    if name is None:
        return item
    check_name(name, f"{f}.name")
    if (item.activations if isinstance(item, SteeringVector) else item.get("activations")) is not None:
        raise ValueError(f"{f}: give either 'name' (a registered vector) or 'activations', not both")
    if registry is None:
        registry = VectorRegistry()  # nothing registered: the error lists none
    entry = registry.entry(scope, name, f"{f}.name")
    t = entry.tensor
    if used is not None:
        used.append(entry)
    layers = item.layer_indices if isinstance(item, SteeringVector) else item.get("layer_indices")
    if t.ndim == 1 and isinstance(layers, (list, tuple, range)) and len(layers) > 0:
        t = t.expand(len(layers), t.shape[0])
    if isinstance(item, SteeringVector):
        return item.model_copy(update={"activations": t, "name": None})
    out = {k: v for k, v in item.items() if k != "name"}
    out["activations"] = t
    return out


def resolve(
    extra_args: Mapping[str, Any], registry: VectorRegistry | None, used: list[Entry] | None = None
) -> Mapping[str, Any]:
    """`extra_args` with named steering entries resolved (and `SCOPE_KEY` consumed): a new dict when
    anything changed, else `extra_args` itself. `used`: gets the registrations `apply_steering_vectors`
    named (those a request may name by reference: `frontend.vector_refs`)."""
    if SCOPE_KEY not in extra_args and STEER_KEY not in extra_args and ACTIONS_KEY not in extra_args:
        return extra_args
    out = dict(extra_args)
    scope = out.pop(SCOPE_KEY, "")
    if not isinstance(scope, str):
        raise ValueError(f"{SCOPE_KEY}: set by the server only")
    if STEER_KEY in out:
        items = from_json_string(out[STEER_KEY], STEER_KEY)
        single = isinstance(items, (SteeringVector, Mapping))
        seq = [items] if single else items
        if isinstance(seq, (list, tuple)) and any(_names(it) for it in seq):
            out[STEER_KEY] = [_resolve_item(it, i, registry, scope, used) for i, it in enumerate(seq)]
        else:
            out[STEER_KEY] = items
    if ACTIONS_KEY in out:
        out[ACTIONS_KEY] = _resolve_actions(from_json_string(out[ACTIONS_KEY], ACTIONS_KEY), registry, scope)
    return out


def _resolve_actions(actions: Any, registry: VectorRegistry | None, scope: str) -> Any:
    """`probe_actions` whose `then.steer` names registered vectors -> new actions carrying the tensors (the
    caller's dicts are never edited); anything malformed is left for `frontend.actions` to name."""
    seq = [actions] if isinstance(actions, Mapping) else actions
    if not isinstance(seq, (list, tuple)):
        return actions
    out = []
    for i, a in enumerate(seq):
        then = a.get("then") if isinstance(a, Mapping) else None
        steer = then.get("steer") if isinstance(then, Mapping) else None
        items = [steer] if isinstance(steer, (SteeringVector, Mapping)) else steer
        if not isinstance(items, (list, tuple)) or not any(_names(it) for it in items):
            out.append(a)
            continue
        assert isinstance(then, Mapping)  # (a steer list was found in it)
        f = f"{ACTIONS_KEY}[{i}].then.steer"
        resolved = [_resolve_item(it, f"{f}[{j}]", registry, scope) for j, it in enumerate(items)]
        out.append({**a, "then": {**then, "steer": resolved}})
    return out


def _names(item: Any) -> bool:
    if isinstance(item, SteeringVector):
        return item.name is not None
    return isinstance(item, Mapping) and "name" in item
