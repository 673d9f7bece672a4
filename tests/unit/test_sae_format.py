"""The SAELens format without an engine: every cfg flag `vllm_worker.sae.load` accepts gives the features and
reconstruction of SAELens's inference math (written out again in `support.saes`), and a flag it does not
implement is a ValueError naming the field, never ignored."""

from __future__ import annotations

import json

import pytest
import torch

from support.saes import random_sae, ref_clamp, ref_decode, ref_encode, save_with
from vllm_worker.sae import load

X = torch.randn(40, 128, generator=torch.Generator().manual_seed(0)) * 3 + 0.5

CASES = {
    "layer_norm": (random_sae(1, normalize="layer_norm"), {}),
    "constant_norm_rescale, no b_dec in": (
        random_sae(2, arch="jumprelu", normalize="constant_norm_rescale", apply_b_dec_to_input=False),
        {},
    ),
    "topk, rescale_acts_by_decoder_norm, layer_norm": (
        random_sae(3, arch="topk", k=10, normalize="layer_norm"),
        {"rescale_acts_by_decoder_norm": True},
    ),
}
CASES["constant_norm_rescale, no b_dec in"][0].threshold -= 0.3  # thresholds < 0 too
CASES["topk, rescale_acts_by_decoder_norm, layer_norm"][0].W_dec *= torch.linspace(0.2, 4, 256).unsqueeze(1)


@pytest.mark.parametrize("case", list(CASES))
def test_flags_encode_decode_and_clamp_as_saelens(case, tmp_path):
    s, extra = CASES[case]
    rescale = bool(extra.get("rescale_acts_by_decoder_norm"))
    got = load(save_with(s, tmp_path / "sae", **extra))
    f, scale = got.encode(X)
    ref = ref_encode(s, X, rescale)
    assert (ref > 0).any() and (ref == 0).any()
    assert (f - ref).abs().max() <= 1e-5 * ref.abs().max()
    n = s.W_dec.norm(dim=-1) if rescale else torch.ones(s.d_sae)  # SAELens's decode divides f by the norms

    def decode(feats: torch.Tensor) -> torch.Tensor:
        return ref_decode(s, feats / n, X)

    mean = X.mean(-1, keepdim=True) if s.normalize == "layer_norm" else None
    want = decode(ref)
    assert (got.decode(f, scale, mean) - want).abs().max() <= 1e-4 * want.abs().max()
    ids, values = [3, 40], torch.tensor([9.0, 0.0])
    clamped = ref.clone()
    clamped[:, ids] = values
    delta = got.clamp_delta(X, torch.tensor(ids), values)
    assert (delta - (decode(clamped) - want)).abs().max() <= 1e-4
    if not rescale:
        assert (X + delta - ref_clamp(s, X, ids, values.tolist())).abs().max() <= 1e-4


def test_jumprelu_threshold_below_zero_keeps_no_negative_feature(tmp_path):
    s, _ = CASES["constant_norm_rescale, no b_dec in"]
    f, _ = load(save_with(s, tmp_path / "sae")).encode(X)
    pre = (X * 128**0.5 / X.norm(dim=-1, keepdim=True)) @ s.W_enc + s.b_enc
    assert ((pre < 0) & (pre > s.threshold)).any()  # rows where `pre * (pre > threshold)` would be negative
    assert (f >= 0).all()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"normalize_activations": "expected_average_only_in"}, "normalize_activations 'expected_average_only_in'"),
        ({"normalize_activations": True}, "normalize_activations 'expected_average_only_in'"),
        ({"normalize_activations": "rms"}, "normalize_activations 'rms' is not supported"),
        ({"apply_b_dec_to_input": "false"}, "apply_b_dec_to_input: expected true or false"),
        ({"rescale_acts_by_decoder_norm": True}, "rescale_acts_by_decoder_norm is only supported for topk"),
        ({"rescale_acts_by_decoder_norm": 1}, "rescale_acts_by_decoder_norm: expected true or false"),
        ({"reshape_activations": "hook_z"}, "reshape_activations 'hook_z'"),
        ({"finetuning_scaling_factor": True}, "finetuning_scaling_factor"),
        ({"architecture": "gated"}, "architecture 'gated'"),
    ],
)
def test_unimplemented_flags_name_the_field(fields, message, tmp_path):
    folder = save_with(random_sae(4), tmp_path / "sae", **fields)
    with pytest.raises(ValueError, match=f"cfg.json: {message}"):
        load(folder)


def test_pre_6_layout_topk(tmp_path):
    """The pre-6.0 layout: hook name at the top level, TopK as a standard SAE with a topk activation."""
    s = random_sae(5, arch="topk", k=7)
    folder = tmp_path / "sae"
    save_with(s, folder)
    cfg = json.loads((folder / "cfg.json").read_text())
    cfg.pop("metadata"), cfg.pop("k")
    cfg.update(architecture="standard", activation_fn_str="topk", activation_fn_kwargs={"k": 7})
    cfg["hook_name"] = "blocks.2.hook_resid_post"
    (folder / "cfg.json").write_text(json.dumps(cfg))
    got = load(folder)
    assert (got.architecture, got.k, got.layer) == ("topk", 7, 2)
    assert (got.encode(X)[0] - ref_encode(s, X)).abs().max() <= 1e-5
