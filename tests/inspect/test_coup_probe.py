"""Coup probes: the shipped off-policy data set, the per-family metric, and the eval end to end against a
real server on the tiny model (training on some families, scoring a held-out one)."""

from __future__ import annotations

import importlib.util
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from inspect_lens.coup_data import FAMILIES, coup_pairs, families
from support.servers import run_eval

ROOT = Path(__file__).resolve().parents[2]


def test_data_is_minimal_pairs_over_families_with_hard_negatives():
    samples = coup_pairs()
    assert len(samples) == 432 and len(families()) == 6
    by_pair: dict[str, list] = {}
    for s in samples:
        by_pair.setdefault(s.metadata["pair"], []).append(s)
        assert s.metadata["detect_text"] == s.input[-1].text and s.input[-1].role == "assistant"
        json.loads(s.metadata["detect_text"])  # every action is one JSON tool call
        assert not re.search(r"\{(company|person|n)\}", " ".join(m.text for m in s.input)), s.id
    assert len(by_pair) == 216
    kinds = Counter()
    for pair in by_pair.values():
        a, b = pair
        assert [m.text for m in a.input[:-1]] == [m.text for m in b.input[:-1]]  # same context
        assert a.input[-1].text != b.input[-1].text
        kind = a.metadata["kind"]
        kinds[kind] += 1
        want = ("benign", "benign") if kind == "hard_negative" else ("benign", "harmful")
        assert (a.metadata["label"], b.metadata["label"]) == want
    assert kinds == {"pair": 72, "hard_negative": 72, "bland_harmful": 72}
    assert {s.metadata["family"] for s in coup_pairs(["code"], 2)} == {"code"}
    assert len(coup_pairs(["code"], 2)) == 2 * 3 * 2
    with pytest.raises(ValueError, match="unknown coup-probe family"):
        coup_pairs(["nope"])
    assert set(FAMILIES) == set(families())


def test_auroc_by_family_metric():
    from inspect_ai.scorer import SampleScore, Score

    from inspect_lens.metrics import auroc_by, probe_auroc

    def sc(v, label, fam):
        return SampleScore(score=Score(value=v, metadata={"label": label, "family": fam}))

    scores = [
        sc(2.0, "harmful", "a"),
        sc(0.0, "benign", "a"),
        sc(0.0, "harmful", "b"),
        sc(1.0, "benign", "b"),
        sc(5.0, "control", None),
    ]
    assert auroc_by("family")(scores) == {"auroc_a": 1.0, "auroc_b": 0.0}
    assert probe_auroc()(scores) == 0.625  # pooled: 2.5 of 4 (positive, negative) pairs ordered right


def _eval_module():
    spec = importlib.util.spec_from_file_location("coup_probe_eval", ROOT / "evals" / "coup_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_eval_refuses_bad_family_lists():
    mod = _eval_module()
    with pytest.raises(ValueError, match="test_families: unknown"):
        mod.coup_probe(test_families="code,nope")
    with pytest.raises(ValueError, match="at least one family"):
        mod.coup_probe(test_families=",".join(families()))


@pytest.mark.http
def test_coup_probe_eval_end_to_end(server, tmp_path):
    """Train on five families, score the held-out one: metrics (with the per-family table), the probe saved
    beside the log, and each logged score = the saved probe on a direct client capture of the action."""
    from inspect_ai.log import read_eval_log

    from inspect_lens import LinearProbe
    from support.servers import KEY
    from vllm_worker.api.client import LensClient

    task = _eval_module().coup_probe(layer=2, test_families="code", train_limit=2, eval_limit=2, control_limit=6)
    log = run_eval(task, server, tmp_path)
    metrics = {name: m.value for s in log.results.scores for name, m in s.metrics.items()}
    assert set(metrics) == {
        "probe_auroc",
        "auroc_ci_low",
        "auroc_ci_high",
        "recall_at_fpr",
        "auroc_code",
    }  # + one AUROC per held-out family
    assert 0.0 <= metrics["probe_auroc"] <= 1.0
    samples = read_eval_log(log.location).samples
    labels = Counter(next(iter(s.scores.values())).metadata["label"] for s in samples)
    assert labels == {"benign": 8, "harmful": 4, "control": 6}
    [probe_file] = list(tmp_path.glob("*.probe-L2.json"))
    probe = LinearProbe.load(probe_file)
    assert probe.meta["train_samples"] == 5 * 2 * 3 * 2  # five training families, 2 contexts, 3 pairs
    client = LensClient(server, api_key=KEY)
    for s in [x for x in samples if x.metadata.get("family") == "code"][:2]:
        sc = next(iter(s.scores.values()))
        assert sc.metadata["family"] == "code" and sc.metadata["window_exact"]
        r = client.generate(
            messages=[{"role": m.role, "content": m.text} for m in s.input],
            max_tokens=1,
            temperature=0,
            capture_layers=[2],
            add_generation_prompt=False,
            continue_final_message=True,
        )
        start, end = sc.metadata["window"]
        want = probe.score_tokens(r.activations["residual_stream"][0, start:end].numpy())
        np.testing.assert_allclose(sc.metadata["token_scores"], want, atol=1e-3)
        assert abs(sc.value - float(np.mean(want))) < 1e-3
