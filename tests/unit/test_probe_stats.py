"""Probe-score statistics: each aggregate against its definition worked by hand, the bootstrap AUROC
interval against a plain resampling loop and against the known AUROC of two normals (coverage), and the
Inspect metric over labelled scores."""

from __future__ import annotations

import math

import numpy as np
import pytest
from inspect_ai.scorer import SampleScore, Score

from inspect_lens import auroc
from inspect_lens.metrics import auroc_ci, probe_auroc, recall_at_fpr
from inspect_lens.probe_stats import aggregate, auroc_bootstrap_ci, parse_aggregate

S = [0.0, 4.0, -2.0, 1.0, 3.0]


def test_aggregates_by_hand():
    assert aggregate(S, "mean") == pytest.approx(1.2)
    assert aggregate(S, "max") == 4.0
    assert aggregate(S, "last") == 3.0
    # windows of 2: 2, 1, -0.5, 2 -> 2; of 3: 2/3, 1, 2/3 -> 1; wider than the response: its mean
    assert aggregate(S, "rolling_max:2") == pytest.approx(2.0)
    assert aggregate(S, "rolling_max:3") == pytest.approx(1.0)
    assert aggregate(S, "rolling_max:99") == pytest.approx(1.2)
    assert aggregate(S, "rolling_max:1") == aggregate(S, "max")
    # e: 0, 2, 0, 0.5, 1.75 -> 2
    assert aggregate(S, "ema:0.5") == pytest.approx(2.0)
    assert aggregate(S, "ema:0") == aggregate(S, "max")
    assert aggregate(np.array([[7.0]]), "last") == 7.0  # (n, 1) scores of one probe output


@pytest.mark.parametrize(
    "bad", ["median", "rolling_max", "rolling_max:0", "rolling_max:2.5", "ema:1", "ema:x", "max:3", 3]
)
def test_bad_aggregate_names_the_field(bad):
    with pytest.raises(ValueError, match="aggregate"):
        parse_aggregate(bad)  # type: ignore[arg-type]


def test_empty_window_is_an_error():
    with pytest.raises(ValueError, match="empty window"):
        aggregate([], "mean")


def test_bootstrap_equals_a_plain_resampling_loop():
    rng = np.random.default_rng(0)
    pos, neg = rng.normal(1, 1, 30).round(1), rng.normal(0, 1, 40).round(1)  # rounded: ties happen
    scores, labels = np.r_[pos, neg], np.r_[np.ones(30), np.zeros(40)]
    lo, hi = auroc_bootstrap_ci(scores, labels, n_boot=200, seed=7, confidence=0.9)
    draws = np.random.default_rng(7)
    ip, ineg = draws.integers(0, 30, (200, 30)), draws.integers(0, 40, (200, 40))
    reps = [auroc(np.r_[pos[a], neg[b]], np.r_[np.ones(30), np.zeros(40)]) for a, b in zip(ip, ineg)]
    assert (lo, hi) == pytest.approx(tuple(np.quantile(reps, [0.05, 0.95])), abs=1e-12)
    assert lo <= auroc(scores, labels) <= hi


def test_bootstrap_interval_covers_the_true_auroc():
    """N(1, 1) vs N(0, 1): true AUROC = Φ(1/√2) ≈ 0.760; 95 % intervals from 60 + 60 samples cover it in
    about 95 % of 120 independent data sets."""
    true = 0.5 * (1 + math.erf(0.5))
    rng = np.random.default_rng(1)
    hits, widths = 0, []
    for seed in range(120):
        s = np.r_[rng.normal(1, 1, 60), rng.normal(0, 1, 60)]
        lo, hi = auroc_bootstrap_ci(s, np.r_[np.ones(60), np.zeros(60)], n_boot=400, seed=seed)
        hits += lo <= true <= hi
        widths.append(hi - lo)
    assert 0.86 <= hits / 120 <= 1.0
    assert 0.1 < float(np.mean(widths)) < 0.25  # ~ 4 standard errors of an AUROC from 60 + 60


def test_bootstrap_refuses_bad_arguments_and_gives_nan_without_a_class():
    with pytest.raises(ValueError, match="confidence"):
        auroc_bootstrap_ci([1, 0], [1, 0], confidence=1.0)
    with pytest.raises(ValueError, match="n_boot"):
        auroc_bootstrap_ci([1, 0], [1, 0], n_boot=0)
    assert all(math.isnan(v) for v in auroc_bootstrap_ci([1.0, 2.0], [1, 1]))


def _ss(value, label):
    return SampleScore(score=Score(value=value, metadata={"label": label}))


def test_auroc_ci_metric_brackets_probe_auroc():
    rng = np.random.default_rng(2)
    scores = (
        [_ss(v, "harmful") for v in rng.normal(1, 1, 50)]
        + [_ss(v, "benign") for v in rng.normal(0, 1, 50)]
        + [_ss(v, "control") for v in rng.normal(5, 1, 50)]  # ignored by AUROC: would break it if counted
    )
    ci = auroc_ci()(scores)
    assert set(ci) == {"auroc_ci_low", "auroc_ci_high"}
    assert ci["auroc_ci_low"] < probe_auroc()(scores) < ci["auroc_ci_high"]
    assert ci == auroc_ci()(scores)  # seeded: the same log gives the same interval
    # threshold fitted on the controls (all ~5): nothing positive is above it
    assert recall_at_fpr(0.01)(scores) == 0.0
