"""Pure statistics over probe scores (no Inspect): the aggregate that turns per-token scores into one
response score, a bootstrap confidence interval for AUROC, and the compact JSON form served scores take
in model outputs (and so in eval logs).

Aggregates are the engine's (`vllm_worker.probes.aggregation`: `mean`, `max`, `last`, `rolling_max:W`,
`ema:α`), one definition for served scores, scorers and calibration.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

AGGREGATES = ("mean", "max", "last", "rolling_max:W", "ema:α")


def parse_aggregate(spec: str) -> str:
    """`spec` checked as the engine checks it (ValueError naming `aggregate`); the name."""
    from vllm_worker.probes.aggregation import names

    if not isinstance(spec, str):
        raise ValueError(f"aggregate: expected one of {AGGREGATES}, got {spec!r}")
    return names(spec, "aggregate")[0]


def aggregate(token_scores: Sequence[float] | np.ndarray, spec: str = "mean") -> float:
    """One response score from its per-token scores (1-D), by the engine's own definition
    (`vllm_worker.probes.aggregation`, float32), so a scorer and a served aggregate agree."""
    import torch

    from vllm_worker.probes.aggregation import aggregate as engine_aggregate

    parse_aggregate(spec)
    s = torch.as_tensor(np.asarray(token_scores, dtype=np.float64).reshape(-1))
    if s.numel() == 0:
        raise ValueError("aggregate: no token scores (empty window)")
    return float(engine_aggregate(s, spec))


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


def compact_scores(scores: Mapping[str, Any]) -> dict[str, list[list[float]]]:
    """{probe: (n_positions, n_out) tensor} as JSON lists at float32's precision (7 significant digits):
    what the eval log keeps instead of tensors (which Inspect would write as null)."""
    return {name: [[float(f"{v:.7g}") for v in row] for row in t.tolist()] for name, t in scores.items()}


def compact_aggregates(aggs: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, list[float]]]:
    return {
        name: {a: [float(f"{v:.7g}") for v in t.reshape(-1).tolist()] for a, t in per.items()}
        for name, per in aggs.items()
    }
