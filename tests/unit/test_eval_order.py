"""Sample order of the shipped evals (Inspect's `--limit N` takes the first N samples: every prefix must hold
every class, evenly), and the provider's LoRA settings for a server it is still to start. No engine, no
server. (evals/control_agentdojo.py: tests/inspect/test_control.py, which imports ControlArena anyway;
evals/petri_audit.py runs Petri's seed instructions: no classes.)"""

from __future__ import annotations

import json

import pytest

from inspect_lens.sample_order import interleave, round_robin
from support import ROOT, load_script
from support.sample_order import assert_balanced_prefixes


def _task(name: str, **args):
    return getattr(load_script(ROOT / "evals" / f"{name}.py"), name)(**args)


def test_round_robin_and_interleave():
    assert round_robin("abc", "d", "ef") == ["a", "d", "e", "b", "f", "c"]
    assert round_robin() == []
    got = interleave([("x", 0), ("x", 1), ("y", 0), ("z", 0), ("y", 1), ("x", 2)], key=lambda t: t[0])
    assert got == [("x", 0), ("y", 0), ("z", 0), ("x", 1), ("y", 1), ("x", 2)]  # first-seen order, stable
    assert_balanced_prefixes([k for k, _ in got], "interleave")
    with pytest.raises(AssertionError, match="not one per class"):
        assert_balanced_prefixes(list("aabb"), "grouped")
    with pytest.raises(AssertionError, match="prefix of 5 is unbalanced"):
        assert_balanced_prefixes(list("abcaab"), "uneven")


@pytest.mark.parametrize(
    "args", [{}, {"eval_limit": 3, "control_limit": 4}, {"eval_limit": 5, "control_limit": 1}], ids=str
)
def test_deception_probe_labels_interleaved(args):
    samples = list(_task("deception_probe", **args).dataset)
    assert_balanced_prefixes([s.metadata["label"] for s in samples], f"deception_probe{args}")
    assert samples[0].metadata["pair"] == samples[1].metadata["pair"]  # a scenario's two answers side by side


@pytest.mark.parametrize("args", [{}, {"test_families": "code", "eval_limit": 2, "control_limit": 3}], ids=str)
def test_coup_probe_families_labels_and_controls_interleaved(args):
    coup = load_script(ROOT / "evals" / "coup_probe.py")
    samples = list(coup.coup_probe(**args).dataset)
    assert_balanced_prefixes([coup.sample_class(s) for s in samples], f"coup_probe{args}")


def test_activation_oracle_topics_interleaved(tmp_path):
    from inspect_lens.oracle_data import TOPICS, topic_texts

    (tmp_path / "oracle.json").write_text(json.dumps({"source_layer": 2, "base_model": "unused"}))
    samples = list(_task("activation_oracle", oracle=str(tmp_path)).dataset)
    assert_balanced_prefixes([s.target for s in samples], "activation_oracle")
    assert len(samples) == 96 and {s.target for s in samples[:8]} == set(TOPICS)
    # ids name the same texts as before the reordering (topic_texts order), so logs stay comparable
    texts = topic_texts(held_out=True)
    assert all((s.input, s.target) == texts[int(s.id.removeprefix("topic-"))] for s in samples)
