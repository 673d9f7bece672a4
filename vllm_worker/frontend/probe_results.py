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

from vllm_worker.probes.aggregation import aggregates_many, aggregates_stacked
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


def _decoded(items: list[tuple[bytes, bytes, int, int]]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Each `(n, n_out)` scores of a fetch's probe items (`probe_wire.unpack`ed) as a view of one writable
    buffer for them all (one copy of their bytes, one tensor made), not a buffer and a tensor per probe;
    and that buffer as `(items, n, n_out)` when they all have one shape (W10's), else None."""
    raw = b"".join([vals for _, vals, _, _ in items])
    if not raw:
        return [torch.empty((n, k), dtype=torch.float32) for _, _, n, k in items], None
    flat = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    n0, k0 = items[0][2], items[0][3]
    if k0 and all(n == n0 and k == k0 for _, _, n, k in items):  # views in one call
        whole = flat.view(-1, n0, k0)
        return list(whole.unbind(0)), whole
    if k0 and all(k == k0 for _, _, _, k in items):  # one width
        return list(flat.view(-1, k0).split([n for _, _, n, _ in items])), None
    return [t.view(n, k) for t, (_, _, n, k) in zip(flat.split([n * k for _, _, n, k in items]), items)], None


Outputs = tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]


def probe_outputs(parts: list[dict], wanted: dict[str, dict[str, Any]], prompt_len: int) -> Outputs:
    """(probe_scores, probe_aggregates) of one sample from its workers' parts (one pipeline stage holds each
    probe's layers: `frontend.probes.check_local`)."""
    return probe_outputs_many([(parts, wanted, prompt_len)])[0]


def probe_outputs_many(samples: list[tuple[list[dict], dict[str, dict[str, Any]], int]]) -> list[Outputs]:
    """`probe_outputs` of every (parts, wanted, prompt_len) sample of a fetch: every sample's scores decoded
    from one buffer, then every sample's and probe's aggregates computed together (`aggregates_stacked`
    reading that buffer in place when every series has one shape and span; else `aggregates_many`)."""
    items: list[tuple[bytes, bytes, int, int]] = []
    names: list[str] = []
    for parts, _, _ in samples:
        for part in parts:
            for name, got in (part.get("probes") or {}).items():
                items.append(probe_wire.unpack(got, f"probe_scores.{name}"))
                names.append(name)
    decoded, whole = _decoded(items) if items else ([], None)
    values = iter(decoded)
    seen: dict[bytes, tuple[np.ndarray, int]] = {}  # positions by their bytes (often the same ones)
    out: list[Outputs] = []
    todo: list[tuple[torch.Tensor, list[str]]] = []
    spans: list[tuple[int, slice]] = []  # (item index, positions) of each todo entry read in place
    k = 0
    for parts, wanted, prompt_len in samples:
        scores: dict[str, torch.Tensor] = {}
        at: dict[str, int] = {}
        for part in parts:
            for _ in part.get("probes") or ():
                pos, n = _positions(items[k][0], seen)
                s = scores[names[k]] = _dense(pos, n, next(values))
                if s.shape[0] == items[k][2]:
                    at[names[k]] = k
                k += 1
        for name, opts in wanted.items():
            s = scores.get(name)
            if s is None:
                raise RuntimeError(f"inspect-lens: no worker returned the scores of probe {name!r}")
            sel = chosen(s.shape[0], prompt_len, opts.get("positions", "generated"))
            todo.append((s, opts["aggregate"]))
            spans.append((at.get(name, -1), sel) if type(sel) is slice else (-1, sel))
        out.append((scores, {}))
    done = iter(_aggregates(todo, spans, whole))
    for (_, wanted, _), (_, aggs) in zip(samples, out):
        for name in wanted:
            aggs[name] = next(done)
    return out


def _aggregates(
    todo: list[tuple[torch.Tensor, list[str]]], spans: list[tuple[int, Any]], whole: torch.Tensor | None
) -> list[dict[str, torch.Tensor]]:
    """The aggregates of each todo entry (scores, names) over its chosen positions (`spans`: the item read in
    place, -1 if none, and the positions): when every entry is an item of `whole` (one buffer, one shape) with
    the same slice of positions, the stacked series are that slice of `whole`, copied once — the tensor
    `aggregates_many` would stack, so the same bits — instead of a slice per entry and a stack of them."""
    sl = spans[0][1] if spans else None
    if whole is not None and type(sl) is slice and all(i >= 0 and s == sl for i, s in spans):
        idx = [i for i, _ in spans]
        x = whole[:, sl] if idx == list(range(whole.shape[0])) else whole[torch.tensor(idx)][:, sl]
        return aggregates_stacked(x.contiguous(), [names for _, names in todo])
    return aggregates_many([(s[sel], names) for (s, names), (_, sel) in zip(todo, spans)])
