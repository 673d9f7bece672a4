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


def _dense(pos: np.ndarray, n: int, scores: torch.Tensor) -> torch.Tensor:
    """Scores by position 0 .. max (`n`: max + 1); a position no worker scored is NaN (never a silent shift)."""
    if len(pos) == n:  # every position once, sorted (the workers sort): as it is
        return scores
    out = torch.full((n, scores.shape[1]), math.nan, dtype=torch.float32)
    out[torch.from_numpy(pos.copy())] = scores  # (a copy: `pos` may be read-only bytes)
    return out


def _positions(obj: dict, field: str, seen: dict) -> tuple[np.ndarray, int]:
    """A probe's positions and their max + 1: read in place (no tensor of their own: callers see only the
    scores by position), checked as `tensor_from_bytes` checks them. `seen`: a part's positions by their
    bytes (its probes at one site, often at all, have the same ones: read once)."""
    data = obj.get("data") if isinstance(obj, dict) else None
    got = seen.get(data) if type(data) is bytes else None
    if got is not None and obj.get("dtype") == "int64" and obj.get("shape") == [len(got[0])]:
        return got
    pos = _checked(obj, field)
    got = (pos, int(pos.max()) + 1 if len(pos) else 0)
    if type(data) is bytes:
        seen[data] = got
    return got


def _checked(obj: dict, field: str) -> np.ndarray:
    """Positions as a numpy array over their bytes (no copy), or through `tensor_from_bytes` (its checks)."""
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


def _plain(obj: Any) -> bool:
    """A float32 (n, n_out) score object whose bytes match its shape (anything else: `tensor_from_bytes`)."""
    if not isinstance(obj, dict) or obj.get("dtype") != "float32" or not isinstance(obj.get("data"), bytes):
        return False
    shape = obj.get("shape")
    if type(shape) is not list or len(shape) != 2:
        return False
    n, k = shape
    return type(n) is int and type(k) is int and n >= 0 and k >= 0 and len(obj["data"]) == 4 * n * k


def _decoded(probes: dict[str, dict]) -> list[torch.Tensor]:
    """The score tensors of one part's probes: one writable buffer for the part (one copy of its bytes, one
    tensor made), each probe's scores a view of it — not a buffer and a tensor per probe."""
    items = [(name, got["scores"]) for name, got in probes.items()]
    if len(items) < 2 or not all(_plain(obj) for _, obj in items):
        return [tensor_from_bytes(obj, f"probe_scores.{name}") for name, obj in items]
    raw = b"".join(obj["data"] for _, obj in items)
    if not raw:
        return [torch.empty(obj["shape"], dtype=torch.float32) for _, obj in items]
    flat = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    width = items[0][1]["shape"][1]
    if width and all(obj["shape"][1] == width for _, obj in items):  # one width (W10's): (n, width) views at once
        return list(flat.view(-1, width).split([obj["shape"][0] for _, obj in items]))
    sizes = [len(obj["data"]) // 4 for _, obj in items]
    return [t.view(obj["shape"]) for t, (_, obj) in zip(flat.split(sizes), items)]


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
            for (name, item), values in zip(got.items(), _decoded(got)):
                scores[name] = _dense(*_positions(item["positions"], f"probe_scores.{name}.positions", seen), values)
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
