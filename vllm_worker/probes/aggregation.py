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
        w = int(arg)
        c = torch.cat([torch.zeros_like(x[:1]), x.cumsum(0, dtype=torch.float64)])
        n = torch.arange(1, x.shape[0] + 1, dtype=torch.float64)
        lo = (n - w).clamp(min=0).long()
        count = (n - lo.double()).reshape(-1, *([1] * (x.dim() - 1)))
        return ((c[1:] - c[lo]) / count).to(torch.float32)
    if kind == "ema":
        out = torch.empty_like(x)
        e = x[0] if x.shape[0] else x.new_zeros(x.shape[1:])
        for t in range(x.shape[0]):
            e = arg * e + (1.0 - arg) * x[t] if t else x[0]
            out[t] = e
        return out
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
