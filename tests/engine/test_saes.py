"""SAEs in the engine (tiny random SAEs in the SAELens format over the tiny llama): features equal a
plain torch encode of the HF capture (ReLU, JumpReLU, TopK; graph-safe and Python paths), feature steering
equals adding the decoder rows in HF, clamping equals encode -> set -> decode done by hand in HF — also for
every cfg flag the loader implements (layer_norm, constant_norm_rescale, apply_b_dec_to_input false,
JumpReLU thresholds < 0, TopK rescale_acts_by_decoder_norm) — a batch-mate without SAE is unchanged, and bad
input is a ValueError naming the field."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.reference import greedy, hf_model, point_activations, residuals, steer_edit
from support.saes import random_sae, ref_clamp, ref_encode, save_with
from vllm_worker.sae import Sae, save

D, D_SAE = 128, 256
PROMPTS = ["the water of people will come down to the side", "a long thing to see him", "how many water did she"]


def _random_sae(seed: int, point: str, layer: int, arch: str, k: int = 0, **kw) -> Sae:
    return random_sae(seed, point, layer, arch, k, D_SAE, **kw)


def _rescaled_topk() -> Sae:
    """A TopK SAE trained with `rescale_acts_by_decoder_norm` (decoder rows of norms 0.3 .. 3)."""
    s = _random_sae(7, "resid_post", 1, "topk", k=12)
    s.W_dec = s.W_dec * torch.linspace(0.3, 3.0, D_SAE).unsqueeze(1)
    return s


def _jump_cn() -> Sae:
    s = _random_sae(6, "resid_post", 3, "jumprelu", normalize="constant_norm_rescale", apply_b_dec_to_input=False)
    s.threshold = s.threshold - 0.3  # some thresholds < 0: SAELens's relu still zeroes negative pre-activations
    return s


SAES = {
    "relu2": _random_sae(1, "resid_post", 2, "standard"),
    "jump1": _random_sae(2, "mlp_out", 1, "jumprelu"),
    "topk3": _random_sae(3, "resid_post", 3, "topk", k=16),
}
# the cfg flags the loader implements: layer_norm, constant_norm_rescale, apply_b_dec_to_input false, JumpReLU
# thresholds below 0, TopK with rescale_acts_by_decoder_norm
NORMED = {
    "ln2": _random_sae(5, "resid_post", 2, "standard", normalize="layer_norm"),
    "cnj3": _jump_cn(),
    "rsk1": _rescaled_topk(),
}
RESCALED = {"rsk1"}


@pytest.fixture(scope="module")
def llm(llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("saes")
    for name, s in {**SAES, **NORMED}.items():
        extra = {"rescale_acts_by_decoder_norm": True} if name in RESCALED else {}
        info = llama.load_sae(name, save_with(s, root / name, **extra))
        assert (info["point"], info["layer"], info["d_sae"]) == (s.point, s.layer, D_SAE)
    assert {s["name"] for s in llama.list_saes()} >= set(SAES)
    return llama


def _sp(n=6, **extra):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, extra_args=extra or None)


def _stream(out, point: str, layer: int, edit=None) -> torch.Tensor:
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    if point == "resid_post":
        return residuals(hf_model("llama"), ids[:-1], edit)[0][layer]
    return point_activations(hf_model("llama"), "llama", ids[:-1])[0][point][layer]


def _check_top_k(got: dict, ref: torch.Tensor, k: int) -> None:
    assert got["indices"].shape == got["values"].shape == (ref.shape[0], k)
    assert torch.equal(got["positions"], torch.arange(ref.shape[0]))
    assert (got["values"] - ref.topk(k, dim=-1).values).abs().max() <= 1e-4
    assert (ref.gather(1, got["indices"]) - got["values"]).abs().max() <= 1e-4  # the ids name those values


def test_features_equal_a_torch_encode_of_the_hf_capture(llm):
    """Graph-safe path (no Python at the taps): three SAEs and a plain batch-mate in one batch."""
    sps = [
        _sp(**{"output_sae_features": {"sae": "relu2", "top_k": 8}}),
        _sp(**{"output_sae_features": [{"sae": "jump1", "features": [0, 5, 9, 200]}, {"sae": "topk3", "top_k": 16}]}),
        _sp(),
    ]
    outs = llm.generate(PROMPTS, sps, use_tqdm=False)
    ref = ref_encode(SAES["relu2"], _stream(outs[0], "resid_post", 2))
    assert (ref > 0).any() and (ref == 0).any()
    _check_top_k(outs[0].activations["sae_features"]["relu2"], ref, 8)
    got = outs[1].activations["sae_features"]
    ref = ref_encode(SAES["jump1"], _stream(outs[1], "mlp_out", 1))
    assert (ref > 0).any() and (ref == 0).any()
    assert got["jump1"]["indices"].tolist() == [0, 5, 9, 200]
    assert (got["jump1"]["values"] - ref[:, [0, 5, 9, 200]]).abs().max() <= 1e-4
    ref = ref_encode(SAES["topk3"], _stream(outs[1], "resid_post", 3))
    assert ((ref > 0).sum(-1) <= 16).all()
    _check_top_k(got["topk3"], ref, 16)
    assert outs[2].activations is None
    assert list(outs[2].outputs[0].token_ids) == greedy(hf_model("llama"), list(outs[2].prompt_token_ids), 6)


def test_feature_steering_adds_the_decoder_rows(llm):
    s = SAES["relu2"]
    sp = _sp(
        8,
        **{
            "apply_sae_steering": [{"sae": "relu2", "features": [3, 7], "scale": [6.0, -4.0]}],
            "output_residual_stream": [2, 3],
        },
    )
    out = llm.generate([PROMPTS[0]], sp, use_tqdm=False)[0]
    edit = steer_edit({2: 6.0 * s.W_dec[3] - 4.0 * s.W_dec[7]})
    prompt = list(out.prompt_token_ids)
    assert list(out.outputs[0].token_ids) == greedy(hf_model("llama"), prompt, 8, edit)
    ids = prompt + list(out.outputs[0].token_ids)
    ref, _ = residuals(hf_model("llama"), ids[:-1], edit)
    assert (out.activations["residual_stream"] - ref[[2, 3]]).abs().max() <= 1e-4


def test_clamping_equals_encode_set_decode_and_spares_the_batch_mate(llm):
    """Python path: the clamp edits the stream at the tap; features there come from the clamped rows."""
    s = SAES["relu2"]
    feats, values = [3, 11], [25.0, 0.0]

    def clamp(layer: int, h: torch.Tensor):
        if layer != 2:
            return None
        f = ref_encode(s, h[0])
        return h + ((torch.tensor(values) - f[:, feats]) @ s.W_dec[feats]).unsqueeze(0)

    sps = [
        _sp(
            8,
            **{
                "apply_sae_clamp": [{"sae": "relu2", "features": feats, "values": values}],
                "output_sae_features": {"sae": "relu2", "features": feats},
            },
        ),
        _sp(8),
    ]
    outs = llm.generate(PROMPTS[:2], sps, use_tqdm=False)
    hf = hf_model("llama")
    prompt = list(outs[0].prompt_token_ids)
    assert list(outs[0].outputs[0].token_ids) == greedy(hf, prompt, 8, clamp)
    assert list(outs[0].outputs[0].token_ids) != greedy(hf, prompt, 8), "the clamp changed nothing"
    got = outs[0].activations["sae_features"]["relu2"]["values"]  # read from the clamped stream
    ref = ref_encode(s, _stream(outs[0], "resid_post", 2, clamp))[:, feats]
    assert (got - ref).abs().max() <= 1e-4
    assert list(outs[1].outputs[0].token_ids) == greedy(hf, list(outs[1].prompt_token_ids), 8)
    assert outs[1].activations is None


def test_normalised_saes_features_and_steering_equal_hf(llm):
    """Graph-safe path, every cfg flag the loader implements: layer_norm (ln2), constant_norm_rescale with
    apply_b_dec_to_input false and JumpReLU thresholds below 0 (cnj3), TopK with rescale_acts_by_decoder_norm
    (rsk1). Feature steering adds the decoder rows as loaded (rsk1's divided by their norms: the folded
    decoder), in the stream's units."""
    ln, cn, rs = NORMED["ln2"], NORMED["cnj3"], NORMED["rsk1"]
    some = list(range(0, D_SAE, 8))
    sps = [
        _sp(
            **{
                "output_sae_features": [
                    {"sae": "ln2", "top_k": 8},
                    {"sae": "cnj3", "features": some},
                    {"sae": "rsk1", "top_k": 12},
                ]
            }
        ),
        _sp(
            8,
            **{
                "apply_sae_steering": [
                    {"sae": "ln2", "features": [3, 7], "scale": [5.0, -3.0]},
                    {"sae": "rsk1", "features": [10, 200], "scale": 4.0},
                ],
                "output_residual_stream": [1, 2, 3],
            },
        ),
    ]
    outs = llm.generate(PROMPTS[:2], sps, use_tqdm=False)
    got = outs[0].activations["sae_features"]
    ref = ref_encode(ln, _stream(outs[0], "resid_post", 2))
    assert (ref > 0).any() and (ref == 0).any()
    _check_top_k(got["ln2"], ref, 8)
    x3 = _stream(outs[0], "resid_post", 3)
    ref = ref_encode(cn, x3)[:, some]
    assert (ref > 0).any() and (ref == 0).any()
    assert got["cnj3"]["indices"].tolist() == some
    assert (got["cnj3"]["values"] - ref).abs().max() <= 1e-4
    x1 = _stream(outs[0], "resid_post", 1)
    ref = ref_encode(rs, x1, rescale=True)
    assert not torch.equal(ref.topk(12).indices, ref_encode(rs, x1).topk(12).indices), "the rescale changed nothing"
    _check_top_k(got["rsk1"], ref, 12)

    norms = rs.W_dec.norm(dim=-1)
    edit = steer_edit(
        {2: 5.0 * ln.W_dec[3] - 3.0 * ln.W_dec[7], 1: 4.0 * (rs.W_dec[10] / norms[10] + rs.W_dec[200] / norms[200])}
    )
    prompt = list(outs[1].prompt_token_ids)
    assert list(outs[1].outputs[0].token_ids) == greedy(hf_model("llama"), prompt, 8, edit)
    ref, _ = residuals(hf_model("llama"), prompt + list(outs[1].outputs[0].token_ids)[:-1], edit)
    assert (outs[1].activations["residual_stream"] - ref[[1, 2, 3]]).abs().max() <= 1e-4


def test_clamping_with_normalised_saes_equals_hf(llm):
    """Python path: clamps through a layer_norm SAE (layer 2) and a constant_norm_rescale JumpReLU SAE (layer
    3) in one request equal encode -> set -> decode with SAELens's normalisation undone, by hand in HF;
    features come from the clamped streams; the batch-mate is untouched."""
    ln, cn = NORMED["ln2"], NORMED["cnj3"]
    clamps = {2: (ln, [3, 11], [20.0, 0.0]), 3: (cn, [1, 2], [15.0, 0.0])}

    def clamp(layer: int, h: torch.Tensor):
        if layer not in clamps:
            return None
        s, ids, values = clamps[layer]
        return ref_clamp(s, h[0], ids, values).unsqueeze(0)

    sps = [
        _sp(
            8,
            **{
                "apply_sae_clamp": [
                    {"sae": "ln2", "features": [3, 11], "values": [20.0, 0.0]},
                    {"sae": "cnj3", "features": [1, 2], "values": [15.0, 0.0]},
                ],
                "output_sae_features": [{"sae": "ln2", "features": [3, 11]}, {"sae": "cnj3", "top_k": 4}],
            },
        ),
        _sp(8),
    ]
    outs = llm.generate(PROMPTS[1:3], sps, use_tqdm=False)
    hf = hf_model("llama")
    prompt = list(outs[0].prompt_token_ids)
    assert list(outs[0].outputs[0].token_ids) == greedy(hf, prompt, 8, clamp)
    assert list(outs[0].outputs[0].token_ids) != greedy(hf, prompt, 8), "the clamps changed nothing"
    got = outs[0].activations["sae_features"]
    ref = ref_encode(ln, _stream(outs[0], "resid_post", 2, clamp))[:, [3, 11]]
    assert (got["ln2"]["values"] - ref).abs().max() <= 1e-4
    _check_top_k(got["cnj3"], ref_encode(cn, _stream(outs[0], "resid_post", 3, clamp)), 4)
    assert list(outs[1].outputs[0].token_ids) == greedy(hf, list(outs[1].prompt_token_ids), 8)
    assert outs[1].activations is None


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"output_sae_features": {"sae": "nope", "top_k": 4}}, "output_sae_features.sae: unknown SAE 'nope'"),
        ({"output_sae_features": {"sae": "relu2", "top_k": 0}}, "output_sae_features.top_k"),
        ({"output_sae_features": {"sae": "relu2", "top_k": 4, "features": [1]}}, "output_sae_features: give exactly"),
        ({"apply_sae_steering": [{"sae": "relu2", "features": [D_SAE]}]}, r"apply_sae_steering\[0\].features"),
        ({"apply_sae_clamp": [{"sae": "relu2", "features": [1]}]}, r"apply_sae_clamp\[0\].values"),
        ({"output_sae_feature": {"sae": "relu2", "top_k": 4}}, "extra_args.output_sae_feature: unknown"),
    ],
)
def test_bad_input_names_the_field(llm, extra, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPTS[0]], _sp(2, **extra), use_tqdm=False)


def test_loading_a_mismatched_sae_names_the_field(llm, tmp_path):
    wide = _random_sae(4, "resid_post", 1, "standard")
    wide.W_enc, wide.b_dec, wide.W_dec = torch.zeros(D + 1, D_SAE), torch.zeros(D + 1), torch.zeros(D_SAE, D + 1)
    with pytest.raises(ValueError, match="d_in: SAE 'wide' reads 129 values per token"):
        llm.load_sae("wide", str(save(wide, tmp_path / "wide")))
    with pytest.raises(ValueError, match="hook_name: layer 9 is out of range"):
        llm.load_sae("deep", str(save(_random_sae(5, "resid_post", 9, "standard"), tmp_path / "deep")))
    with pytest.raises(ValueError, match="name: expected"):
        llm.load_sae("a b", str(tmp_path / "wide"))
    assert "wide" not in {s["name"] for s in llm.list_saes()}
