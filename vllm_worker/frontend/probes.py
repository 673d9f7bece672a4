"""Probes in the frontend: the registry of loaded probes (`llm.load_probe`, `POST /v1/lens/probes`), checked
against the served model before any worker loads them, and `output_probe_scores` of a request turned into
work for the workers (`RequestSpec.probes`) and what the frontend makes of their scores afterwards
(`RequestSpec.probe_outputs`: which aggregates, over which positions)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from vllm_worker import compat
from vllm_worker.frontend.state import engine_shape, engine_state
from vllm_worker.probes import aggregation
from vllm_worker.probes.format import Probe, check_probe, load_probe_files
from vllm_worker.protocol import points as pts
from vllm_worker.protocol import rpc
from vllm_worker.protocol.checks import int_list, vector_name
from vllm_worker.protocol.spec import PROBE_SCORES_KEY, ModelShape, RequestSpec, from_json_string
from vllm_worker.protocol.wire import tensor_to_bytes

DEFAULT_AGGREGATES = ("mean", "max", "last")  # always computed, beside the probe file's and the request's
POSITIONS = ("generated", "all", "prompt")
# what `llm.load_probe(name, weight=..., ...)` takes (`format.check_probe`'s fields)
PARTS = (
    "weight",
    "bias",
    "layers",
    "point",
    "output",
    "threshold",
    "aggregate",
    "mean",
    "std",
    "model",
    "metadata",
)  # named position sets of aggregates (default: generated)


@dataclass
class LoadedProbe:
    name: str
    path: str | None  # resolved folder; None for a probe given as tensors
    uid: str  # hash of its tensors and fields: workers check it, logs record it (provenance)
    probe: Probe
    sites: list[int]  # one per layer, in the order of `probe.layers`
    # an action's condition per output, as sent (`frontend.actions.probe_wire`): the tensors never change
    conditions: dict[Any, tuple] = field(default_factory=dict, repr=False, compare=False)

    def describe(self) -> dict[str, Any]:
        p = self.probe
        return {
            "name": self.name,
            "path": self.path,
            "hash": self.uid,
            "layers": list(p.layers),
            "point": p.point,
            "output": p.output,
            "n_out": p.n_out,
            "d_model": p.d_model,
            "threshold": p.threshold,
            "aggregate": list(p.aggregate),
            "model": p.model,
        }

    def wire(self) -> dict[str, Any]:
        """What `lens_load_probe` takes: plain values and tensor bytes (no pickle, no file reads in the workers)."""
        p = self.probe
        out: dict[str, Any] = {"layers": list(p.layers), "point": p.point, "output": p.output}
        for key in ("weight", "bias", "mean", "std"):
            t = getattr(p, key)
            out[key] = None if t is None else tensor_to_bytes(t)
        return out


def check_name(name: Any) -> str:
    """A probe name: 1-128 URL-safe characters (a path segment of `DELETE /v1/lens/probes/{name}`)."""
    return vector_name(name, "name")


def probe_uid(p: Probe) -> str:
    h = hashlib.sha256(repr((p.layers, p.point, p.output)).encode())
    for t in (p.weight, p.bias, p.mean, p.std):
        h.update(b"-" if t is None else t.numpy().tobytes())
    return h.hexdigest()[:16]


def prepare(name: Any, path: Any, shape: ModelShape, parts: Mapping[str, Any] | None = None) -> LoadedProbe:
    """Read (from `path`) or take (`parts`: weight, bias, layers, ...) a probe and check it against this
    model (ValueError naming the field); nothing is registered yet."""
    name = check_name(name)
    if path is not None:
        if parts:
            raise ValueError(f"path: give a probe folder or its tensors (weight=...), not both ({sorted(parts)})")
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"path: expected a probe folder (probe.safetensors + probe.json), got {path!r}")
        folder: str | None = os.path.realpath(str(path))
        probe = load_probe_files(str(folder))
    else:
        unknown = sorted(set(parts or ()) - set(PARTS))
        if unknown:
            raise ValueError(
                f"{unknown[0]}: not a probe field{pts.closest(unknown[0], PARTS)} (fields: {', '.join(PARTS)})"
            )
        if not parts or parts.get("weight") is None:
            raise ValueError("weight: needed (or the path of a probe folder)")
        folder = None
        probe = check_probe(**parts)
    for i, layer in enumerate(probe.layers):
        if layer >= shape.n_layers:
            raise ValueError(f"layers[{i}]: layer {layer} is out of range for a model with {shape.n_layers} layers")
    pts.check_available(probe.point, "point", shape.missing)
    _check_row_width(probe.point, shape)
    if probe.d_model != shape.d_model:
        raise ValueError(
            f"weight: probe {name!r} reads {probe.d_model} values per token and layer, but {probe.point} of this "
            f"model has d_model {shape.d_model}"
        )
    sites = [pts.canonical_site(probe.point, layer) for layer in probe.layers]
    return LoadedProbe(name, folder, probe_uid(probe), probe, sites)


def _check_row_width(point: str, shape: ModelShape) -> None:
    """The workers score one d_model-wide staged row per position and site: a point whose rows have another
    width (mlp_post's d_mlp, carried in pieces; the router's n_experts; q / k / z where the heads' width is
    not d_model) would be scored over the wrong values or fail mid-request, so it is refused at load."""
    if point in (pts.MLP_POST, pts.ROUTER_LOGITS):
        what = "d_mlp wide, carried in d_model-wide pieces" if point == pts.MLP_POST else "n_experts wide"
        raise ValueError(f"point: probes read rows d_model wide; {point} is {what} (not supported by probes)")
    heads = {pts.Q: shape.n_heads, pts.Z: shape.n_heads, pts.K: shape.n_kv_heads}.get(point)
    if heads is not None and heads * shape.d_head != shape.d_model:
        raise ValueError(
            f"point: probes read rows d_model ({shape.d_model}) wide; {point} of this model is {heads} heads x "
            f"{shape.d_head} = {heads * shape.d_head} wide (not supported by probes)"
        )


def _positions(value: Any, f: str) -> Any:
    if isinstance(value, str):
        if value not in POSITIONS:
            raise ValueError(f"{f}: expected one of {list(POSITIONS)} or a list of positions, got {value!r}")
        return value
    got = int_list(value, f, "positions")
    if not got or any(p < 0 for p in got):
        raise ValueError(f"{f}: expected a non-empty list of non-negative positions, got {got[:8]}")
    return sorted(set(got))


def _entries(value: Any) -> list[tuple[str, Any]]:
    """(name, options) pairs of `output_probe_scores`: a name, a list of names, or {name: options}."""
    if isinstance(value, str) and value.strip()[:1] not in ("[", "{"):
        return [(value, None)]
    value = from_json_string(value, PROBE_SCORES_KEY)
    if isinstance(value, Mapping):
        return [(k, v) for k, v in value.items()]
    if isinstance(value, (list, tuple)) and value:
        return [(v, None) for v in value]
    raise ValueError(
        f"{PROBE_SCORES_KEY}: expected a list of probe names or {{name: {{aggregate, positions}}}}, got {value!r}"
    )


def parse(ours: Mapping[str, Any], spec: RequestSpec, registry: Mapping[str, LoadedProbe]) -> None:
    """`output_probe_scores` into `spec.probes` and `spec.probe_outputs`; ValueError naming the field."""
    if PROBE_SCORES_KEY not in ours:
        return
    for name, opts in _entries(ours[PROBE_SCORES_KEY]):
        f = f"{PROBE_SCORES_KEY}.{name}" if isinstance(name, str) else PROBE_SCORES_KEY
        if not isinstance(name, str):
            raise ValueError(f"{PROBE_SCORES_KEY}: expected probe names, got {name!r}")
        got = registry.get(name)
        if got is None:
            loaded = ", ".join(sorted(registry)) or "none; load one with llm.load_probe / POST /v1/lens/probes"
            raise ValueError(f"{f}: unknown probe {name!r}{pts.closest(name, registry)} (loaded: {loaded})")
        if name in spec.probe_outputs:
            raise ValueError(f"{f}: probe {name!r} asked for twice (results are keyed by probe)")
        if opts is None or opts is True:
            opts = {}
        if not isinstance(opts, Mapping):
            raise ValueError(f"{f}: expected an object with aggregate and positions, got {opts!r}")
        unknown = sorted(set(opts) - {"aggregate", "positions"})
        if unknown:
            raise ValueError(f"{f}: unknown fields {unknown}{pts.closest(unknown[0], ('aggregate', 'positions'))}")
        wanted = aggregation.names(opts.get("aggregate", []), f"{f}.aggregate")
        names = list(dict.fromkeys([*DEFAULT_AGGREGATES, *got.probe.aggregate, *wanted]))
        positions = _positions(opts.get("positions", "generated"), f"{f}.positions")
        spec.probes.append({"probe": name, "uid": got.uid})
        spec.probe_outputs[name] = {"aggregate": names, "positions": positions, "output": got.probe.output}
    spec.probe_outputs = shared_outputs(spec.probe_outputs)


_SHARED: dict[tuple, dict[str, dict[str, Any]]] = {}
_SHARED_MAX = 256


def shared_outputs(outputs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One object for requests asking for the same probe outputs (read-only from here on: the frontend's
    pending entry and the fetch only read them). Each request held its own dict and list per probe until it
    finished: 17 tracked objects a W10 request that a long batch promotes to the collector's oldest
    generation. Only options naming their positions ("generated", ...) are shared, so the memo stays small."""
    if not all(type(o["positions"]) is str for o in outputs.values()):
        return outputs
    key = tuple((name, tuple(o["aggregate"]), o["positions"], o["output"]) for name, o in outputs.items())
    got = _SHARED.get(key)
    if got is None:
        if len(_SHARED) >= _SHARED_MAX:
            _SHARED.clear()
        got = _SHARED[key] = outputs
    return got


def check_local(loaded: LoadedProbe, answers: list) -> None:
    """Every worker holds all of the probe's layers or none (pipeline stages are not gathered across):
    ValueError naming `layers` otherwise."""
    n = len(loaded.probe.layers)
    for got in answers:
        k = len((got or {}).get("local_layers") or ())
        if 0 < k < n:
            raise ValueError(
                f"layers: probe {loaded.name!r} reads layers {loaded.probe.layers}, which lie on different pipeline "
                "stages; a multi-layer probe must read layers of one stage (serve with a pipeline split that keeps "
                "them together, or load one probe per stage)"
            )


# ---------------------------------------------------------------- offline `vllm.LLM` methods


def load_probe(self: Any, name: str, path: str | None = None, **parts: Any) -> dict[str, Any]:
    """Load a probe under `name` in every worker: from a folder (`path`), or from tensors
    (`weight=`, `bias=`, `layers=`, `point=`, `output=`, `mean=`, `std=`, `threshold=`, `aggregate=`). A
    request names it in `output_probe_scores`. Loading a name again replaces it."""
    loaded = prepare(name, path, engine_shape(compat.processor_of_llm(self)), parts)
    answers = compat.rpc(self, rpc.LOAD_PROBE, loaded.name, loaded.uid, loaded.wire())
    try:
        check_local(loaded, answers)
    except ValueError:
        compat.rpc(self, rpc.DELETE_PROBE, loaded.name)
        raise
    engine_state(self).probes[loaded.name] = loaded
    return loaded.describe()


def list_probes(self: Any) -> list[dict[str, Any]]:
    return [p.describe() for p in engine_state(self).probes.values()]


def delete_probe(self: Any, name: str) -> bool:
    """True when `name` was loaded (and is now gone); requests already admitted with it still finish."""
    had = engine_state(self).probes.pop(name, None) is not None
    compat.rpc(self, rpc.DELETE_PROBE, name)
    return had


METHODS: dict[str, Any] = {"load_probe": load_probe, "list_probes": list_probes, "delete_probe": delete_probe}
