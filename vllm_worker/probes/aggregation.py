"""Aggregates of per-token probe scores: pure torch functions, no vLLM import, so the engine's frontend,
Inspect scorers and calibration compute them the same way.

A name is `mean`, `max`, `last`, `rolling_max:W` (the largest mean of W consecutive scores; of all of
them when there are fewer than W) or `ema:A` (the largest value of the exponential moving average
e_t = A * e_(t-1) + (1 - A) * s_t, e_0 = s_0). The running forms (`series`) are what a threshold is compared
with token by token; `max` and `ema:A` are the largest value of their series, so "the aggregate exceeds t"
means "the series crossed t" (the rolling series also averages the first W - 1 positions, over fewer).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

SIMPLE = ("mean", "max", "last")
WINDOWED = ("rolling_max", "ema")
TOKEN = "token"  # the per-token scores themselves (a series, as `max` reduces it)


def parse(name: Any, field: str = "aggregate") -> tuple[str, float]:
    """(kind, parameter) of an aggregate name; ValueError naming `field` for anything else."""
    if not isinstance(name, str):
        raise ValueError(f"{field}: expected an aggregate name (mean, max, last, rolling_max:W, ema:A), got {name!r}")
    if name in SIMPLE or name == TOKEN:
        return name, 0.0
    kind, _, arg = name.partition(":")
    if kind == "rolling_max":
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"{field}: rolling_max needs a window of at least 1 token (rolling_max:16), got {name!r}")
        return kind, float(int(arg))
    if kind == "ema":
        try:
            a = float(arg)
        except ValueError:
            a = math.nan
        if not 0.0 <= a < 1.0:
            raise ValueError(f"{field}: ema needs a decay A with 0 <= A < 1 (ema:0.9), got {name!r}")
        return kind, a
    raise ValueError(f"{field}: unknown aggregate {name!r}; expected mean, max, last, rolling_max:W or ema:A")


def names(value: Any, field: str = "aggregate") -> list[str]:
    """A list of aggregate names (one name alone is a list of one), checked, duplicates dropped."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{field}: expected a list of aggregate names, got {value!r}")
    out: list[str] = []
    for i, n in enumerate(value):
        kind, _ = parse(n, f"{field}[{i}]")
        if kind == TOKEN:
            raise ValueError(f"{field}[{i}]: 'token' is a series, not an aggregate (use max)")
        if n not in out:
            out.append(n)
    return out


def series(scores: torch.Tensor, name: str) -> torch.Tensor:
    """The running form of `name` over positions (dim 0) of `scores` (n,) or (n, n_out), in float32:
    `token` the scores, `rolling_max:W` the mean of the W scores ending at each position (of the first
    W - 1 positions: of those so far), `ema:A` the moving average. Other names have no running form."""
    kind, arg = parse(name)
    x = scores.to(torch.float32)
    if kind in (TOKEN, "max"):
        return x
    if kind == "rolling_max":
        return _rolling_rows(x.unsqueeze(0), int(arg))[0]
    if kind == "ema":
        return _ema_rows(x.unsqueeze(0), arg)[0]
    raise ValueError(f"aggregate: {name!r} has no running form (only token, rolling_max:W, ema:A)")


def aggregate(scores: torch.Tensor, name: str) -> torch.Tensor:
    """`name` over positions (dim 0) of `scores` (n,) or (n, n_out): a float32 scalar or (n_out,) tensor;
    NaN when there are no positions."""
    kind, arg = parse(name)
    x = scores.to(torch.float32)
    if x.shape[0] == 0:
        return torch.full(x.shape[1:], math.nan, dtype=torch.float32)
    if kind == "mean":
        return x.mean(0)
    if kind == "last":
        return x[-1].clone()
    if kind == TOKEN:
        raise ValueError("aggregate: 'token' is a series, not an aggregate (use max)")
    if kind == "rolling_max" and x.shape[0] >= int(arg):  # full windows only
        return series(x, name)[int(arg) - 1 :].max(0).values
    if kind == "rolling_max":
        return x.mean(0)
    return series(x, name).max(0).values


def aggregates(scores: torch.Tensor, wanted: Iterable[str]) -> dict[str, torch.Tensor]:
    """{name: aggregate} for every name in `wanted`."""
    return {n: aggregate(scores, n) for n in wanted}


def _rolling_rows(x: torch.Tensor, w: int) -> torch.Tensor:
    """The rolling mean (window `w`; of the first w - 1 positions: of those so far) of every row of `x`
    (rows, n, ...) along its positions, from float64 running sums."""
    c = torch.cat([torch.zeros_like(x[:, :1], dtype=torch.float64), x.cumsum(1, dtype=torch.float64)], 1)
    n = torch.arange(1, x.shape[1] + 1, dtype=torch.float64)
    lo = (n - w).clamp(min=0).long()
    count = (n - lo.double()).reshape(1, -1, *([1] * (x.dim() - 2)))
    return ((c[:, 1:] - c[:, lo]) / count).to(torch.float32)


def _ema_rows(x: torch.Tensor, a: float) -> torch.Tensor:
    """The ema series of every row of `x` (rows, n, ...) at once: one step of the recurrence per position
    for all rows, the same float32 operations as one row alone (so the same bits), not a loop per row."""
    out = torch.empty_like(x)
    if x.shape[1]:
        e = out[:, 0] = x[:, 0]
        for t in range(1, x.shape[1]):
            e = out[:, t] = a * e + (1.0 - a) * x[:, t]
    return out


def _stacked_aggregate(x: torch.Tensor, name: str) -> torch.Tensor:
    """`aggregate` of each of the equal-shaped series stacked in `x` (rows, n, ...) -> (rows, ...): the
    same reductions along the same axis per series, so bit-identical to one series at a time
    (tests/unit/test_aggregation_many.py)."""
    kind, arg = parse(name)
    if x.shape[1] == 0:
        return torch.full((x.shape[0], *x.shape[2:]), math.nan, dtype=torch.float32)
    if kind == "mean" or (kind == "rolling_max" and x.shape[1] < int(arg)):
        return x.mean(1)
    if kind == "last":
        return x[:, -1].clone()  # (not a view: each row would keep every series alive)
    if kind == "max":  # (`amax`: the same values, without finding the indices `max` returns)
        return x.amax(1)
    if kind == "rolling_max":
        return _rolling_rows(x, int(arg))[:, int(arg) - 1 :].amax(1)
    if kind == "ema":
        return _ema_rows(x, arg).amax(1)
    raise ValueError("aggregate: 'token' is a series, not an aggregate (use max)")


def aggregates_many(items: list[tuple[torch.Tensor, list[str]]]) -> list[dict[str, torch.Tensor]]:
    """`aggregates(scores, wanted)` of every (scores, wanted) item at once: series of one shape are stacked
    and each aggregate is a few tensor operations for all of them (a fetch's requests x probes), instead of
    a few per series. Equal to `aggregates` bit for bit; each result is its own row of a shared tensor."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in items]
    groups: dict[tuple, list[int]] = {}
    for i, (scores, _) in enumerate(items):
        groups.setdefault((tuple(scores.shape), scores.dtype), []).append(i)
    for members in groups.values():
        x = torch.stack([items[i][0] for i in members]).to(torch.float32)
        for i, got in zip(members, aggregates_stacked(x, [items[i][1] for i in members])):
            out[i] = got
    return out


def aggregates_stacked(x: torch.Tensor, wanted: list[list[str]]) -> list[dict[str, torch.Tensor]]:
    """`aggregates(x[i], wanted[i])` of every row of `x` (rows, n, ...) float32, the series already stacked
    (as `aggregates_many` stacks them, or read in place by a caller holding them in one buffer)."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in wanted]
    if wanted and wanted.count(wanted[0]) == len(wanted):  # one list for every row (a fetch's usual case)
        names = wanted[0]
        per_name = [_stacked_aggregate(x, name).unbind(0) for name in names]
        if len(names) == 3:  # (the defaults alone, a request's usual case: a dict display, not dict(zip))
            a, b, c = names
            return [{a: u, b: v, c: w} for u, v, w in zip(*per_name)]
        return [dict(zip(names, rows)) for rows in zip(*per_name)] if per_name else out
    for name in dict.fromkeys(n for w in wanted for n in w):
        for i, row in enumerate(_stacked_aggregate(x, name).unbind(0)):
            if name in wanted[i]:
                out[i][name] = row
    for i, w in enumerate(wanted):  # each dict in `wanted`'s order, as `aggregates` makes it
        if list(out[i]) != list(w):
            out[i] = {n: out[i][n] for n in w}
    return out
