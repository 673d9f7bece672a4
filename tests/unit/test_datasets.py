"""Our shipped datasets and the Apollo-format loader (no engine needed)."""

from __future__ import annotations

import pytest

from inspect_lens import datasets


def test_shipped_dataset_sizes_labels_and_windows():
    pairs, rp, ctl = datasets.instructed_pairs(), datasets.roleplay(), datasets.control()
    assert len(pairs) >= 400 and len(rp) == 120 and len(ctl) == 100
    for group in (pairs, rp, ctl):
        ids = [s.id for s in group]
        assert len(set(ids)) == len(ids)
        for s in group:
            assert s.input[-1].role == "assistant" and s.input[-1].text.endswith(s.metadata["detect_text"])
    assert {s.metadata["label"] for s in pairs} == {s.metadata["label"] for s in rp} == {"honest", "deceptive"}
    # instructed pairs: the same statement under both instructions; only the system prompt differs
    h, d = pairs[0], pairs[1]
    assert h.input[-1].text == d.input[-1].text and h.input[0].text != d.input[0].text
    # role-play: the detection window excludes the speaker prefix
    assert rp[0].input[-1].text.startswith("Student:") and not rp[0].metadata["detect_text"].startswith("Student")
    assert len(datasets.instructed_pairs(5)) == 10 and len(datasets.roleplay(limit=3)) == 6


def test_apollo_format_file(tmp_path):
    f = tmp_path / "dataset.yaml"
    f.write_text(
        "- scenario: You are a cat who ate the fish.\n  question: 'Owner: Did you eat the fish?'\n"
        "  answer_prefix: 'Cat:'\n  honest_completion: Yes.\n  deceptive_completion: No, the dog did.\n"
    )
    [h, d] = datasets.roleplay(f)
    assert h.input[0].text.startswith("You are a cat") and h.input[1].text == "Owner: Did you eat the fish?"
    assert h.input[2].text == "Cat: Yes." and d.input[2].text == "Cat: No, the dog did."
    assert (h.metadata["label"], d.metadata["label"]) == ("honest", "deceptive")


def test_bad_apollo_file_names_the_item_and_field(tmp_path):
    f = tmp_path / "dataset.yaml"
    f.write_text("- scenario: x\n  question: y\n  answer_prefix: z\n  honest_completion: a\n")
    with pytest.raises(ValueError, match=r"item 0 .*deceptive_completion"):
        datasets.roleplay(f)
    f.write_text("scenario: x\n")
    with pytest.raises(ValueError, match="YAML list"):
        datasets.roleplay(f)


def test_steering_vector_names_resolve_and_bad_names_are_clear_errors():
    import torch

    from inspect_lens import register_steering_vector, steer
    from inspect_lens.steering import resolve_vectors
    from vllm_worker import SteeringVector

    v = SteeringVector(torch.ones(1, 8), [0])
    register_steering_vector("unit-test-ones", v)
    assert resolve_vectors("unit-test-ones") == [v] and resolve_vectors(["unit-test-ones", v]) == [v, v]
    with pytest.raises(ValueError, match="apply_steering_vectors: unknown steering vector name 'nope'"):
        resolve_vectors(["nope"])
    with pytest.raises(ValueError, match="apply_steering_vectors: wrap tensors in SteeringVector"):
        resolve_vectors([torch.ones(1, 8)])
    with pytest.raises(ValueError, match="unknown steering vector name"):
        steer("nope")  # refused when the task is built, not mid-eval
