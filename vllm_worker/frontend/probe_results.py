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
from vllm_worker.protocol import probe_wire


def _dense(pos: np.ndarray, n: int, scores: torch.Tensor) -> torch.Tensor:
    """Scores by position 0 .. max (`n`: max + 1); a position no worker scored is NaN (never a silent shift)."""
    if len(pos) == n:  # every position once, sorted (the workers sort): as it is
        return scores
    out = torch.full((n, scores.shape[1]), math.nan, dtype=torch.float32)
    out[torch.from_numpy(pos.copy())] = scores  # (a copy: `pos` may be read-only bytes)
    return out


def _positions(pos: bytes, seen: dict) -> tuple[np.ndarray, int]:
    """A probe's positions and their max + 1: read in place (no tensor of their own: callers see only the
    scores by position). `seen`: a part's positions by their bytes (its probes at one site, often at all,
    have the same ones: read once)."""
    got = seen.get(pos)
    if got is None:
        arr = np.frombuffer(pos, dtype=np.int64)
        got = seen[pos] = (arr, int(arr.max()) + 1 if len(arr) else 0)
    return got


def chosen(n: int, prompt_len: int, positions: Any) -> torch.Tensor | slice:
    """The positions (< n) that aggregates are taken over: a range as a slice (a view, no copy)."""
    if positions == "all":
        return slice(0, n)
    if positions == "prompt":
        return slice(0, min(n, prompt_len))
    if positions == "generated":
        return slice(max(prompt_len - 1, 0), n)
    return torch.tensor([p for p in positions if p < n], dtype=torch.long)


def _decoded(probes: dict[str, Any]) -> list[tuple[bytes, torch.Tensor]]:
    """(positions' bytes, scores) of one part's probes (`protocol.probe_wire` items, checked): one writable
    buffer for the part (one copy of its bytes, one tensor made), each probe's `(n, n_out)` scores a view of
    it — not a buffer and a tensor per probe."""
    items = [probe_wire.unpack(got, f"probe_scores.{name}") for name, got in probes.items()]
    raw = b"".join(vals for _, vals, _, _ in items)
    if not raw:
        return [(pos, torch.empty((n, k), dtype=torch.float32)) for pos, _, n, k in items]
    flat = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    width = items[0][3]
    if width and all(k == width for _, _, _, k in items):  # one width (W10's): (n, width) views at once
        return list(zip([pos for pos, _, _, _ in items], flat.view(-1, width).split([n for _, _, n, _ in items])))
    parts = flat.split([n * k for _, _, n, k in items])
    return [(pos, t.view(n, k)) for t, (pos, _, n, k) in zip(parts, items)]


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
            got = part.get("probes") or {}
            seen: dict[bytes, tuple[np.ndarray, int]] = {}
            for name, (pos, values) in zip(got, _decoded(got)):
                scores[name] = _dense(*_positions(pos, seen), values)
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
