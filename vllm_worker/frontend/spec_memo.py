"""Specs remembered per engine: a request whose inspect-lens keys only ask for results read the same way
for every request — captures (`output_residual_stream`, `output_activations`) and probe scores
(`output_probe_scores`) — is validated once per distinct value, not once per request. An extraction sends
thousands of requests with one capture, a monitored batch hundreds with one list of probes; validating each
again was most of what our frontend added to a request on its way to the engine (docs/decisions.md).

A remembered spec holds no caller object. Its lists and dicts are shared by every request of that value
and never changed: they are only read (`Pending`, `fetch.by_point`, which copies what it hands to callers;
the workers `decode` their own copies), so a request costs no new lists either, which the garbage collector
would otherwise walk while thousands of requests are in flight. One that names probes is used only while
each of those names still holds the probe it was validated against: a probe loaded again under its name,
or deleted, sends the next request through validation again."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from vllm_worker.frontend.state import FrontendState
from vllm_worker.frontend.validation import parse_request
from vllm_worker.protocol.spec import (
    ACTIVATIONS_KEY,
    CAPTURE_KEY,
    NAMESPACE_PREFIXES,
    PROBE_SCORES_KEY,
    ModelShape,
    RequestSpec,
)

KEPT = 64  # distinct specs remembered per engine (then the memo starts over)
KEYS = frozenset({CAPTURE_KEY, ACTIVATIONS_KEY, PROBE_SCORES_KEY})  # keys whose spec does not depend on the prompt


@dataclass(frozen=True)
class Remembered:
    points: dict[str, list[int]]
    capture: list[int]
    probes: list[dict[str, Any]]  # `RequestSpec.probes`: {"probe", "uid"} per probe
    probe_outputs: dict[str, dict[str, Any]]
    used: tuple[tuple[str, Any], ...]  # (name, the registry's `LoadedProbe`) it was validated against


def frozen(value: Any) -> Any:
    """A hashable form of a JSON-like value that tells `True` from `1` and a list from a tuple; None for
    anything else (tensors, ranges, objects: validated every time)."""
    t = type(value)
    if t is str or t is int or t is bool:
        return (t, value)
    if t is list or t is tuple:
        items = tuple(frozen(v) for v in value)
        return None if None in items else (t, items)
    if t is dict:
        pairs = tuple((k, frozen(v)) for k, v in value.items())
        return None if any(type(k) is not str or v is None for k, v in pairs) else (t, pairs)
    return None


def remembered_spec(state: FrontendState, extra_args: Any, shape: ModelShape) -> RequestSpec | None:
    """The spec of a request whose only inspect-lens keys are `KEYS`, with a fresh key of its own; None for
    any other request (validated by `parse_request` every time). A bad value raises the ValueError
    `parse_request` raises, every time (nothing is remembered for it)."""
    ours = [k for k in extra_args if isinstance(k, str) and k.startswith(NAMESPACE_PREFIXES)]
    if not ours or any(k not in KEYS for k in ours):
        return None
    key = tuple((k, frozen(extra_args[k])) for k in ours)
    if any(v is None for _, v in key):
        return None
    got = state.specs.get(key)
    if got is not None and got.used:
        probes = state.probes
        if not all(probes.get(name) is loaded for name, loaded in got.used):
            got = None  # (a probe it names was loaded again or deleted since)
    if got is None:
        spec = parse_request({k: extra_args[k] for k in ours}, shape, 0, None, state.probes)
        assert spec is not None  # `ours` is not empty
        used = tuple((u["probe"], state.probes[u["probe"]]) for u in spec.probes)
        got = Remembered(spec.points, spec.capture, spec.probes, spec.probe_outputs, used)
        if len(state.specs) >= KEPT:
            state.specs.clear()
        state.specs[key] = got
    # a fresh random key, as `parse_request` makes (32 hex digits; without building a UUID object)
    return RequestSpec(
        key=os.urandom(16).hex(),
        capture=got.capture,
        points=got.points,
        probes=got.probes,
        probe_outputs=got.probe_outputs,
    )
