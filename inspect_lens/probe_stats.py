"""Pure statistics over probe scores (numpy only, no Inspect): the aggregate that turns per-token scores
into one response score, and a bootstrap confidence interval for AUROC.

Aggregates (the names the engine's `output_probe_scores` aggregates use): `mean`, `max`, `last`,
`rolling_max:W` (max over positions of the mean of W consecutive scores; the mean of all when fewer than
W) and `ema:α` (the highest value of the exponential moving average `e_t = α·e_{t-1} + (1-α)·s_t`,
`e_0 = s_0`: a score that stays high, not a single spike, raises it).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

AGGREGATES = ("mean", "max", "last", "rolling_max:W", "ema:α")


def parse_aggregate(spec: str) -> tuple[str, float | None]:
    """`"rolling_max:16"` -> ("rolling_max", 16.0); a bad name or parameter is a ValueError naming it."""
    if not isinstance(spec, str):
        raise ValueError(f"aggregate: expected one of {AGGREGATES}, got {spec!r}")
    name, _, arg = spec.partition(":")
    if name in ("mean", "max", "last") and not arg:
        return name, None
    if name == "rolling_max" and arg.isdigit() and int(arg) >= 1:
        return name, float(int(arg))
    if name == "ema" and arg:
        try:
            alpha = float(arg)
        except ValueError:
            alpha = float("nan")
        if 0.0 <= alpha < 1.0:
            return name, alpha
    raise ValueError(f"aggregate: expected one of {AGGREGATES} (W an integer >= 1, 0 <= α < 1), got {spec!r}")


def aggregate(token_scores: Sequence[float] | np.ndarray, spec: str = "mean") -> float:
    """One response score from its per-token scores (1-D), by the aggregate `spec`."""
    name, arg = parse_aggregate(spec)
    s = np.asarray(token_scores, dtype=np.float64).reshape(-1)
    if s.size == 0:
        raise ValueError("aggregate: no token scores (empty window)")
    if name == "mean":
        return float(s.mean())
    if name == "max":
        return float(s.max())
    if name == "last":
        return float(s[-1])
    if name == "rolling_max":
        w = min(int(arg or 1), s.size)
        c = np.concatenate([[0.0], np.cumsum(s)])
        return float(((c[w:] - c[:-w]) / w).max())
    alpha = float(arg or 0.0)
    e = s[0]
    best = e
    for x in s[1:]:
        e = alpha * e + (1.0 - alpha) * x
        best = max(best, e)
    return float(best)


def _pair_matrix(pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """1 where a positive outscores a negative, 0.5 on ties, 0 otherwise: (n_pos, n_neg)."""
    return (pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])


def auroc_bootstrap_ci(
    scores: Sequence[float],
    labels: Sequence[int],
    *,
    confidence: float = 0.95,
    n_boot: int = 1000,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of AUROC: positives and negatives resampled separately (stratified,
    so every replicate has both classes), `n_boot` replicates, fixed `seed` (the same log gives the same
    interval). NaN, NaN without both classes."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: expected a value in (0, 1), got {confidence}")
    if n_boot < 1:
        raise ValueError(f"n_boot: expected >= 1, got {n_boot}")
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels).astype(int)
    pos, neg = s[y == 1], s[y == 0]
    if pos.size == 0 or neg.size == 0:
        return float("nan"), float("nan")
    m = _pair_matrix(pos, neg)
    rng = np.random.default_rng(seed)
    ip = rng.integers(0, pos.size, size=(n_boot, pos.size))
    ineg = rng.integers(0, neg.size, size=(n_boot, neg.size))
    # AUROC of a replicate = mean of m over its resampled rows and columns: count each row/column's draws
    row_w = np.stack([np.bincount(r, minlength=pos.size) for r in ip]).astype(np.float64)
    col_w = np.stack([np.bincount(c, minlength=neg.size) for c in ineg]).astype(np.float64)
    reps = np.einsum("bi,ij,bj->b", row_w, m, col_w) / (pos.size * neg.size)
    tail = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(reps, [tail, 1.0 - tail])
    return float(lo), float(hi)
