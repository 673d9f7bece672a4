"""The probe scores of a finished sample, as callers get them: `activations["probe_scores"][name]`, a float32
`(n_positions, n_out)` tensor over the positions of captures (0 .. prompt + generated - 2), and
`activations["probe_aggregates"][name]` = {aggregate name: (n_out,) float32} over the positions the
request chose (by default those whose forward pass produced a generated token: the last prompt position
onward)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from vllm_worker.probes.aggregation import aggregates_many
from vllm_worker.protocol.wire import tensor_from_bytes


def _dense(pos: np.ndarray, scores: torch.Tensor) -> torch.Tensor:
    """Scores by position 0 .. max; a position no worker scored is NaN (never a silent shift)."""
    n = int(pos.max()) + 1 if len(pos) else 0
    if len(pos) == n:  # every position once, sorted (the workers sort): as it is
        return scores
    out = torch.full((n, scores.shape[1]), math.nan, dtype=torch.float32)
    out[torch.from_numpy(pos.copy())] = scores  # (a copy: `pos` may be read-only bytes)
    return out


def _positions(obj: dict, field: str) -> np.ndarray:
    """A probe's positions: read in place (no tensor of their own: callers see only the scores by position),
    checked as `tensor_from_bytes` checks them."""
    if (
        isinstance(obj, dict)
        and obj.get("dtype") == "int64"
        and isinstance(obj.get("data"), bytes)
        and isinstance(obj.get("shape"), list)
        and len(obj["shape"]) == 1
        and len(obj["data"]) == 8 * obj["shape"][0]
    ):
        return np.frombuffer(obj["data"], dtype=np.int64)
    return tensor_from_bytes(obj, field).numpy()  # anything else: its checks name the field


def chosen(n: int, prompt_len: int, positions: Any) -> torch.Tensor | slice:
    """The positions (< n) that aggregates are taken over: a range as a slice (a view, no copy)."""
    if positions == "all":
        return slice(0, n)
    if positions == "prompt":
        return slice(0, min(n, prompt_len))
    if positions == "generated":
        return slice(max(prompt_len - 1, 0), n)
    return torch.tensor([p for p in positions if p < n], dtype=torch.long)


Outputs = tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]


def probe_outputs(parts: list[dict], wanted: dict[str, dict[str, Any]], prompt_len: int) -> Outputs:
    """(probe_scores, probe_aggregates) of one sample from its workers' parts (one pipeline stage holds each
    probe's layers: `frontend.probes.check_local`)."""
    return probe_outputs_many([(parts, wanted, prompt_len)])[0]


def probe_outputs_many(samples: list[tuple[list[dict], dict[str, dict[str, Any]], int]]) -> list[Outputs]:
    """`probe_outputs` of every (parts, wanted, prompt_len) sample of a fetch: each sample's scores decoded,
    then every sample's and probe's aggregates computed together (`aggregation.aggregates_many`)."""
    out: list[Outputs] = []
    todo: list[tuple[torch.Tensor, list[str]]] = []
    for parts, wanted, prompt_len in samples:
        scores: dict[str, torch.Tensor] = {}
        for part in parts:
            for name, got in (part.get("probes") or {}).items():
                pos = _positions(got["positions"], f"probe_scores.{name}.positions")
                scores[name] = _dense(pos, tensor_from_bytes(got["scores"], f"probe_scores.{name}"))
        for name, opts in wanted.items():
            s = scores.get(name)
            if s is None:
                raise RuntimeError(f"inspect-lens: no worker returned the scores of probe {name!r}")
            todo.append((s[chosen(s.shape[0], prompt_len, opts.get("positions", "generated"))], opts["aggregate"]))
        out.append((scores, {}))
    done = iter(aggregates_many(todo))
    for (_, wanted, _), (_, aggs) in zip(samples, out):
        for name in wanted:
            aggs[name] = next(done)
    return out
