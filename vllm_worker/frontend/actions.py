"""`probe_actions`: act on a score in the same generation (docs/probes.md, "Acting on a score"), checked
in the frontend and turned into the workers' msgspec-safe action dicts.

Each action watches one linear score at one layer's `resid_post` — a loaded probe's (`"probe": name`) or a
direction given inline (`"direction": [...]`, `"layer": L`: CAST's condition vector; one output of a
multi-output probe: `"output": k`) — aggregates it over the positions it watches (by default those that
produce generated tokens; `"positions"` names others), and when the aggregate first exceeds `threshold`,
stops the request or switches steering on. The steering goes into the request's ordinary steering list with a gate
(`Steer.gate`: the action's index), so it travels and is validated like any other steering vector."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from vllm_worker.api.steering import SteeringVector
from vllm_worker.probes import aggregation
from vllm_worker.protocol import points as pts
from vllm_worker.protocol.checks import all_finite, finite_number
from vllm_worker.protocol.spec import ACTIONS_KEY, ModelShape, RequestSpec, Steer, from_json_string
from vllm_worker.protocol.wire import tensor_from_json, tensor_to_bytes

FIELDS = {"probe", "output", "name", "direction", "layer", "bias", "threshold", "aggregate", "positions", "then"}
GENERATED, ALL = "generated", "all"  # `positions`' names
THEN = ("stop", "steer")
MAX_WINDOW = 256  # rolling_max:W, the most positions a window holds (its state lives on the device)
MAX_ACTIONS = 8  # per request
MAX_RANGES = 16  # ranges / single positions in one action's `positions` (the workers' table holds as many)
# positions watched lie below this (`end` at most it): the workers keep them as int64 and use it as a range's
# open end (`worker.actions.NO_END`); a larger one, admitted, failed the action table's flush for the step
MAX_POSITION = 1 << 62
# the aggregate kinds as the workers know them
TOKEN, EMA, ROLLING = 0, 1, 2

SteerParser = Callable[[Any, str, ModelShape, int], Steer]


def parse(
    value: Any,
    spec: RequestSpec,
    shape: ModelShape,
    prompt_len: int,
    steer_item: SteerParser,
    probes: Mapping[str, Any] | None = None,
) -> None:
    """Validate `probe_actions` into `spec.actions` (and their gated steering into `spec.steers`).
    `steer_item(item, field, shape, prompt_len)`: the steering-vector check of `validation`. `probes`: the
    loaded probes by name (resolved to a weight row, a layer and a bias: `probe_condition`)."""
    items = from_json_string(value, ACTIONS_KEY)
    if isinstance(items, Mapping):
        items = [items]
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"{ACTIONS_KEY}: expected a non-empty list of actions, got {type(items).__name__}")
    if len(items) > MAX_ACTIONS:
        raise ValueError(f"{ACTIONS_KEY}: at most {MAX_ACTIONS} actions per request, got {len(items)}")
    for i, item in enumerate(items):
        spec.actions.append(_action(item, i, spec, shape, prompt_len, steer_item, probes or {}))


def _action(
    item: Any,
    i: int,
    spec: RequestSpec,
    shape: ModelShape,
    prompt_len: int,
    steer_item: SteerParser,
    probes: Mapping[str, Any],
) -> dict[str, Any]:
    f = f"{ACTIONS_KEY}[{i}]"
    if not isinstance(item, Mapping):
        raise ValueError(f"{f}: expected a mapping with 'probe' (or 'direction' and 'layer'), 'threshold', 'then'")
    unknown = set(item) - FIELDS
    if unknown:
        name = sorted(unknown)[0]
        raise ValueError(f"{f}: unknown fields {sorted(unknown)}{pts.closest(name, FIELDS)}")
    if ("probe" in item) == ("direction" in item):
        raise ValueError(f"{f}: give either 'probe' (a loaded probe's name) or 'direction' with 'layer'")
    if "probe" in item:
        for k in ("layer", "bias"):
            if k in item:
                raise ValueError(f"{f}.{k}: only with 'direction' (a probe brings its own)")
        name, sites, wire, b, sigmoid = probe_wire(
            item["probe"], f"{f}.probe", probes, item.get("output"), f"{f}.output"
        )
    else:
        if "output" in item:
            raise ValueError(f"{f}.output: only with 'probe' (a direction has one output)")
        layer, w, b = _direction(item, f, shape)
        name, sites, sigmoid = item.get("name", "direction"), [pts.canonical_site(pts.RESID_POST, layer)], False
        wire = tensor_to_bytes(w.unsqueeze(0))
    if "name" in item and "probe" in item:
        raise ValueError(f"{f}.name: only with 'direction' (a probe's action is named for the probe)")
    if not isinstance(name, str) or not name or len(name) > 128:
        raise ValueError(f"{f}.name: expected a non-empty string of at most 128 characters, got {name!r}")
    if "threshold" not in item:
        raise ValueError(f"{f}.threshold: required")
    thr = finite_number(item["threshold"], f"{f}.threshold")
    kind, param = _aggregate(item.get("aggregate", "token"), f"{f}.aggregate")
    ranges = watched(item.get("positions", GENERATED), f"{f}.positions")
    then = item.get("then")
    out: dict[str, Any] = {
        "name": name,
        "sites": sites,
        "w": wire,
        "b": float(b),
        "sigmoid": sigmoid,
        "threshold": float(thr),
        "kind": kind,
        "param": float(param),
        "stop": then == "stop",
        "ranges": ranges,
    }
    if then == "stop":
        return out
    if not isinstance(then, Mapping) or set(then) != {"steer"}:
        raise ValueError(
            f'{f}.then: expected "stop" or {{"steer": SteeringVector(...) or a list of them}}, got {then!r}'
        )
    steers = then["steer"]
    if isinstance(steers, (SteeringVector, Mapping)):
        steers = [steers]
    if not isinstance(steers, (list, tuple)) or not steers:
        raise ValueError(f"{f}.then.steer: expected a SteeringVector or a non-empty list of them")
    for j, s in enumerate(steers):
        st = steer_item(s, f"{f}.then.steer[{j}]", shape, prompt_len)
        if st.mul:
            raise ValueError(f"{f}.then.steer[{j}]: scaling heads cannot be gated by a probe yet")
        if st.positions is not None:
            raise ValueError(f"{f}.then.steer[{j}].activations: a gated vector is 2-D (n_layers, d_model)")
        if st.op != 0:
            raise ValueError(f"{f}.then.steer[{j}].op: a probe action switches on additions only (op='add')")
        if st.span is not None:
            raise ValueError(f"{f}.then.steer[{j}].phase: a probe action's vector applies after it fires (phase='all')")
        st.gate = i
        spec.steers.append(st)
    return out


def _direction(item: Mapping[str, Any], f: str, shape: ModelShape) -> tuple[int, torch.Tensor, float]:
    if "layer" not in item:
        raise ValueError(f"{f}.layer: required with 'direction'")
    layer = item["layer"]
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise ValueError(f"{f}.layer: expected an int, got {layer!r}")
    if not -shape.n_layers <= layer < shape.n_layers:
        raise ValueError(f"{f}.layer: layer {layer} is out of range for a model with {shape.n_layers} layers")
    d = item["direction"]
    if isinstance(d, Mapping):
        d = tensor_from_json(d, f"{f}.direction")
    try:
        w = torch.as_tensor(d, dtype=torch.float32).detach().to("cpu").clone()
    except (TypeError, ValueError, RuntimeError, OverflowError):  # (OverflowError: an int past float, from JSON)
        raise ValueError(f"{f}.direction: expected a list of {shape.d_model} numbers or a tensor") from None
    if w.ndim != 1 or w.shape[0] != shape.d_model:
        raise ValueError(f"{f}.direction: expected shape ({shape.d_model},), got {tuple(w.shape)}")
    if not all_finite(w):
        raise ValueError(f"{f}.direction: contains NaN or inf")
    b = finite_number(item.get("bias", 0.0), f"{f}.bias")
    return layer % shape.n_layers, w, float(b)


def probe_wire(
    name: Any, f: str, probes: Mapping[str, Any], output: Any = None, fo: str = "output"
) -> tuple[str, list[int], dict[str, Any], float, bool]:
    """`probe_condition` with its weight rows in wire form, worked out once per loaded probe and output: a
    loaded probe's tensors are its own and never change (`frontend.probes.prepare`), so every request
    naming it gets equal values (its own lists and dict; the bytes, immutable, shared)."""
    loaded = probes.get(name) if isinstance(name, str) else None
    # (a memo key only for the outputs that can be valid: None or an exact int; others are checked every time)
    memo = getattr(loaded, "conditions", None) if output is None or type(output) is int else None
    got = None if memo is None else memo.get(output)
    if got is None:
        label, rows, w, b, sigmoid = probe_condition(name, f, probes, output, fo)
        got = (label, tuple(rows), tensor_to_bytes(w), b, sigmoid)
        if memo is not None:
            memo[output] = got
    label, kept, wire, b, sigmoid = got
    return label, list(kept), {**wire, "shape": list(wire["shape"])}, b, sigmoid


def probe_condition(
    name: Any, f: str, probes: Mapping[str, Any], output: Any = None, fo: str = "output"
) -> tuple[str, list[int], torch.Tensor, float, bool]:
    """A loaded probe (`frontend.probes.LoadedProbe`) as a condition: (name, sites, weight rows
    (n_sites, d_model), bias, sigmoid) — `mean` / `std` folded in as the workers score it (`Probe.folded`);
    a multi-layer probe is the sum of one part per layer. `output`: which output column (required when the
    probe has several; the action is then named `<probe>[k]`, so each output's stop reason is its own)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{f}: expected a probe name, got {name!r}")
    loaded = probes.get(name)
    if loaded is None:
        known = ", ".join(sorted(probes)) or "none"
        raise ValueError(f"{f}: no probe named {name!r} is loaded (loaded: {known})")
    p = loaded.probe
    if output is None:
        if p.n_out != 1:
            raise ValueError(f"{fo}: required: probe {name!r} has {p.n_out} outputs (give the index of one)")
        k = 0
    elif isinstance(output, bool) or not isinstance(output, int) or not 0 <= output < p.n_out:
        raise ValueError(f"{fo}: expected an output index in 0..{p.n_out - 1} of probe {name!r}, got {output!r}")
    else:
        k = output
    ws, bias = p.folded()
    sites = [pts.canonical_site(p.point, int(layer)) for layer in p.layers]
    label = name if p.n_out == 1 else f"{name}[{k}]"
    return label, sites, torch.stack([w[k] for w in ws]).contiguous(), float(bias[k]), p.output == "sigmoid"


def watched(value: Any, f: str) -> list[list[int]]:
    """`positions` as the absolute ranges [lo, hi) the workers watch (lo -1: the last prompt position,
    `"generated"`; hi -1: no end)."""
    if value == GENERATED:
        return [[-1, -1]]
    if value == ALL:
        return [[0, -1]]
    if isinstance(value, Mapping):
        return [_range(value, f)]
    if isinstance(value, (list, tuple)) and value and len(value) <= MAX_RANGES:
        out = []
        for j, v in enumerate(value):
            if isinstance(v, Mapping):
                out.append(_range(v, f"{f}[{j}]"))
            elif isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < MAX_POSITION:
                raise ValueError(f"{f}[{j}]: expected a position (an int in [0, 2**62)) or a range, got {v!r}")
            else:
                out.append([v, v + 1])
        return out
    raise ValueError(
        f'{f}: expected "generated" (default), "all", a range {{"start": position, "end": position (optional, '
        f"exclusive)}} or a list of at most {MAX_RANGES} positions and ranges, got {value!r}"
    )


def _range(value: Mapping[str, Any], f: str) -> list[int]:
    if not set(value) or not set(value) <= {"start", "end"} or "start" not in value:
        raise ValueError(f'{f}: expected a range {{"start": position, "end": position (optional)}}, got {value!r}')
    lo, hi = value["start"], value.get("end", None)
    for k, v, top, said in (("start", lo, MAX_POSITION - 1, ")"), ("end", hi, MAX_POSITION, "]")):
        if (v is not None or k == "start") and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top):
            raise ValueError(f"{f}.{k}: expected a position (an int in [0, 2**62{said}), got {v!r}")
    if hi is not None and hi <= lo:
        raise ValueError(f"{f}.end: expected a position after start ({lo}), got {hi!r}")
    return [int(lo), -1 if hi is None else int(hi)]


def _aggregate(value: Any, f: str) -> tuple[int, float]:
    """An action's aggregate (`probes.aggregation`'s names, the running ones only) as its device code."""
    if value != aggregation.TOKEN and not (isinstance(value, str) and value.startswith(aggregation.WINDOWED)):
        raise ValueError(f'{f}: expected "token", "ema:α" or "rolling_max:W", got {value!r}')
    kind, arg = aggregation.parse(value, f)
    if kind == "rolling_max" and arg > MAX_WINDOW:
        raise ValueError(f"{f}: rolling_max:W needs an integer W in 1..{MAX_WINDOW}, got {value!r}")
    return {aggregation.TOKEN: TOKEN, "ema": EMA, "rolling_max": ROLLING}[kind], arg
