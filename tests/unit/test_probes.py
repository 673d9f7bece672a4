"""Probe library on synthetic data: a planted direction is found (AUROC ~ 1), noise is not (~ 0.5),
the threshold hits the requested FPR on a control set, and files round-trip without pickle."""

from __future__ import annotations

import json

import numpy as np
import pytest
from inspect_ai.scorer import SampleScore, Score

from inspect_lens import LinearProbe, auroc, threshold_at_fpr
from inspect_lens.metrics import probe_auroc, recall_at_fpr

D = 64


def _data(n, planted: bool, seed: int):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    x = rng.normal(size=(n, D)) * rng.uniform(0.5, 3, D)  # uneven scales: standardization matters
    if planted:
        direction = rng.normal(size=D)
        x += np.outer(2 * y - 1, direction / np.linalg.norm(direction)) * 2.0
    return x, y


def test_planted_direction_gives_auroc_near_one_and_noise_near_half():
    x, y = _data(2000, True, 0)
    probe = LinearProbe.fit(x[:1000], y[:1000], layer=3)
    assert auroc(probe.score_tokens(x[1000:]), y[1000:]) > 0.97
    xn, yn = _data(2000, False, 1)
    noise = LinearProbe.fit(xn[:1000], yn[:1000])
    assert abs(auroc(noise.score_tokens(xn[1000:]), yn[1000:]) - 0.5) < 0.06


def test_response_score_is_the_mean_over_the_window():
    x, y = _data(400, True, 2)
    probe = LinearProbe.fit(x, y)
    acts = x[:10]
    assert probe.score_response(acts, (2, 7)) == pytest.approx(probe.score_tokens(acts[2:7]).mean())
    with pytest.raises(ValueError, match="empty detection window"):
        probe.score_response(acts, (5, 5))


def test_threshold_hits_requested_fpr_on_held_out_controls():
    rng = np.random.default_rng(3)
    control = rng.normal(size=20000)
    t = threshold_at_fpr(control[:10000], 0.01)
    assert (control[:10000] > t).mean() <= 0.01
    assert abs((control[10000:] > t).mean() - 0.01) < 0.004


def test_save_load_is_json_and_exact(tmp_path):
    x, y = _data(300, True, 4)
    probe = LinearProbe.fit(x, y, layer=7)
    probe.calibrate(probe.score_tokens(x[y == 0]), 0.05)
    path = probe.save(tmp_path / "p.json")
    assert json.loads(path.read_text())["format"] == "inspect-lens-linear-probe/1"
    back = LinearProbe.load(path)
    assert back.layer == 7 and back.threshold == probe.threshold
    assert np.array_equal(back.score_tokens(x), probe.score_tokens(x))
    (tmp_path / "bad.json").write_text('{"format": "pickle"}')
    with pytest.raises(ValueError, match="not an inspect-lens probe"):
        LinearProbe.load(tmp_path / "bad.json")


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="both classes"):
        LinearProbe.fit(np.zeros((4, 2)), np.zeros(4))
    with pytest.raises(ValueError, match=r"acts \(N, d\)"):
        LinearProbe.fit(np.zeros(4), np.zeros(4))


def _ss(value, label):
    return SampleScore(score=Score(value=value, metadata={"label": label}))


def test_inspect_metrics():
    rng = np.random.default_rng(5)
    scores = (
        [_ss(v, "deceptive") for v in rng.normal(3, 1, 200)]
        + [_ss(v, "honest") for v in rng.normal(0, 1, 200)]
        + [_ss(v, "control") for v in rng.normal(0, 1, 1000)]
    )
    assert probe_auroc()(scores) > 0.95
    r = recall_at_fpr(0.01)(scores)
    assert 0.5 < r < 0.95  # threshold ~ 2.33 sigma of the controls; deceptive mean 3 sigma
    assert np.isnan(recall_at_fpr(0.01)([s for s in scores if s.score.metadata["label"] != "control"]))


def test_served_format_round_trip(tmp_path):
    """`save_served` writes the engine's format; the engine's reference scorer (`Probe.score`, float32) on
    the same activations equals `score_tokens`, and the folder loads back as the same probe."""
    import torch

    from vllm_worker.probes.format import load_probe_files

    x, y = _data(300, True, 6)
    x = x * 5 + 3  # off-centre, uneven scales: mean / std matter
    probe = LinearProbe.fit(x, y, layer=7)
    probe.calibrate(probe.score_tokens(x[y == 0]), 0.05)
    probe.meta["model"] = "tiny"
    folder = probe.save_served(tmp_path / "served")
    cfg = json.loads((folder / "probe.json").read_text())
    assert (cfg["layers"], cfg["output"], cfg["d_model"], cfg["aggregate"], cfg["model"]) == (
        [7],
        "logit",
        D,
        ["mean"],
        "tiny",
    )
    assert cfg["threshold"] == pytest.approx(probe.threshold, rel=1e-6)
    served = load_probe_files(folder).score(torch.as_tensor(x, dtype=torch.float32))[:, 0].double().numpy()
    np.testing.assert_allclose(served, probe.score_tokens(x), atol=1e-4)
    back = LinearProbe.load(folder)  # a folder loads as the served format
    assert back.layer == 7 and back.calibrated_fpr == 0.05 and back.meta["model"] == "tiny"
    np.testing.assert_allclose(back.score_tokens(x), probe.score_tokens(x), atol=1e-4)
    with pytest.raises(ValueError, match="layer"):
        LinearProbe.fit(x, y).save_served(tmp_path / "nolayer")


def test_probe_hash_names_the_file_or_folder(tmp_path):
    import hashlib

    from inspect_lens.scorers import probe_hash

    x, y = _data(100, True, 8)
    probe = LinearProbe.fit(x, y, layer=1)
    f = probe.save(tmp_path / "p.json")
    assert probe_hash(probe, f) == hashlib.sha256(f.read_bytes()).hexdigest()[:16]
    d = probe.save_served(tmp_path / "served")
    both = (d / "probe.safetensors").read_bytes() + (d / "probe.json").read_bytes()
    assert probe_hash(probe, d) == hashlib.sha256(both).hexdigest()[:16]
    assert probe_hash(probe, None) == probe_hash(LinearProbe.load(f), None)  # same probe, same hash
