"""Transcoders in the engine (SAELens's layout: the encoder reads `mlp_in`, the decoder writes `mlp_out`), on
the tiny llama: the features equal a torch encode of the captured `mlp_in` (and of HF's), the decoder's
reconstruction of the captured `mlp_out` is reported, feature steering adds decoder rows at `mlp_out`,
clamping adds decode(f') - decode(f) there with f read at `mlp_in` — HF fp32 with the same edit by hand at
prompt and generated positions, a batch-mate untouched — and bad transcoder folders name their field."""

from __future__ import annotations

import json

import pytest
import torch
from vllm import SamplingParams

from support.reference import hf_model, point_activations
from support.saes import random_transcoder, ref_encode
from vllm_worker.sae import Sae, load, save

D, D_SAE = 128, 192
PROMPTS = ["the water of people will come down to the side", "a long thing to see him", "how many water did she"]
TCS: dict[str, Sae] = {}  # the module's transcoders, as loaded by the fixture


def _transcoder(seed: int, layer: int, arch: str = "standard", skip: bool = False, **kw) -> Sae:
    return random_transcoder(seed, layer, arch, skip, D_SAE, **kw)


def _sp(n=5, **extra):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, extra_args=extra or None)


def _ids(o) -> list[int]:
    return list(o.prompt_token_ids) + list(o.outputs[0].token_ids)[:-1]


@pytest.fixture(scope="module")
def llm(llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("transcoders")
    tcs = {
        "tc1": _transcoder(1, 1),
        "tj2": _transcoder(2, 2, "jumprelu", normalize="constant_norm_rescale"),
        "ts3": _transcoder(3, 3, skip=True),
    }
    for name, tc in tcs.items():
        info = llama.load_sae(name, str(save(tc, root / name)))
        assert (info["kind"], info["point"], info["out_point"], info["layer"]) == (
            "transcoder",
            "mlp_in",
            "mlp_out",
            tc.layer,
        ), info
        assert info["hook_name"] == f"blocks.{tc.layer}.ln2.hook_normalized"
        assert info["hook_name_out"] == f"blocks.{tc.layer}.hook_mlp_out"
    TCS.update(tcs)
    return llama


def test_transcoder_features_equal_a_torch_encode_of_the_captured_mlp_in(llm):
    """Graph-safe path: three transcoders and a plain batch-mate; the reconstruction of mlp_out reported."""
    tcs = TCS
    sps = [
        _sp(output_sae_features={"sae": "tc1", "top_k": 8}, output_activations={"mlp_in": [1], "mlp_out": [1]}),
        _sp(
            output_sae_features=[{"sae": "tj2", "features": [0, 4, 50]}, {"sae": "ts3", "top_k": 12}],
            output_activations={"mlp_in": [2, 3], "mlp_out": [3]},
        ),
        _sp(),
    ]
    outs = llm.generate(PROMPTS, sps, use_tqdm=False)
    a = outs[0].activations
    ref = ref_encode(tcs["tc1"], a["mlp_in"][0])
    assert (ref > 0).any() and (ref == 0).any()
    got = a["sae_features"]["tc1"]
    assert torch.equal(got["positions"], torch.arange(ref.shape[0]))
    assert (got["values"] - ref.topk(8, dim=-1).values).abs().max() <= 1e-4
    assert (ref.gather(1, got["indices"]) - got["values"]).abs().max() <= 1e-4
    hf = point_activations(hf_model("llama"), "llama", _ids(outs[0]))[0]
    assert (a["mlp_in"][0] - hf["mlp_in"][1]).abs().max() <= 1e-4  # the captured mlp_in is HF's
    # the decoder's reconstruction of the captured mlp_out, reported (random weights: no fit expected)
    y = a["mlp_out"][0].float()
    recon = tcs["tc1"].decode(ref)
    fvu = ((recon - y).pow(2).sum() / (y - y.mean(0)).pow(2).sum()).item()
    print(f"transcoder tc1 (layer 1, random weights): mlp_out reconstruction FVU {fvu:.3f}")
    assert recon.shape == y.shape and torch.isfinite(recon).all(), f"reconstruction FVU {fvu:.3f}"
    b = outs[1].activations
    ref = ref_encode(tcs["tj2"], b["mlp_in"][0])
    assert b["sae_features"]["tj2"]["indices"].tolist() == [0, 4, 50]
    assert (b["sae_features"]["tj2"]["values"] - ref[:, [0, 4, 50]]).abs().max() <= 1e-4
    ref = ref_encode(tcs["ts3"], b["mlp_in"][1])
    assert (b["sae_features"]["ts3"]["values"] - ref.topk(12, dim=-1).values).abs().max() <= 1e-4
    skip = tcs["ts3"].reconstruct(b["mlp_in"][1])  # the skip term is part of the reconstruction
    assert skip.shape == b["mlp_out"][0].shape
    assert outs[2].activations is None


def test_transcoder_steering_and_clamping_write_mlp_out_and_equal_hf(llm):
    """Feature steering: + sum scale * W_dec[f] at mlp_out of the transcoder's layer (graph-safe). Clamping
    (Python path): f encoded from mlp_in, decode(f') - decode(f) added at mlp_out. Both equal HF with the
    edit by hand at every prompt and generated position; the batch-mate runs plain."""
    tc = TCS["tc1"]
    feats, values = [2, 9], [6.0, 0.0]
    capture = {"mlp_out": [1], "resid_post": [1, 3]}
    sps = [
        _sp(
            6, apply_sae_steering=[{"sae": "tc1", "features": feats, "scale": [3.0, -2.0]}], output_activations=capture
        ),
        _sp(6, apply_sae_clamp=[{"sae": "tc1", "features": feats, "values": values}], output_activations=capture),
        _sp(6, output_activations=capture),
    ]
    steer_out, clamp_out, plain_out = llm.generate([PROMPTS[0]] * 3, sps, use_tqdm=False)
    add = 3.0 * tc.W_dec[2] - 2.0 * tc.W_dec[9]

    def steer(where, layer, h):
        return h + add if (where, layer) == ("mlp_out", 1) else None

    seen: dict[str, torch.Tensor] = {}

    def clamp(where, layer, h):
        if layer != 1:
            return None
        if where == "mlp_in":
            f = ref_encode(tc, h)
            seen["delta"] = (torch.tensor(values) - f[:, feats]) @ tc.W_dec[feats]
        if where == "mlp_out":
            return h + seen["delta"]
        return None

    hf = hf_model("llama")
    for out, edit, what in ((steer_out, steer, "steered"), (clamp_out, clamp, "clamped"), (plain_out, None, "plain")):
        ref, logits = point_activations(hf, "llama", _ids(out), edit)
        for p, layers in capture.items():
            err = (out.activations[p] - ref[p][layers]).abs().max().item()
            assert err <= 1e-4, f"{what} {p}: {err:.2e}"
        n = len(out.prompt_token_ids)
        assert logits[n - 1 :].argmax(-1).tolist() == list(out.outputs[0].token_ids), what
    for out in (steer_out, clamp_out):
        moved = (out.activations["resid_post"][1] - plain_out.activations["resid_post"][1]).abs().max()
        assert moved > 1e-2, "the edit did nothing downstream"


def _folder(tmp_path, tc: Sae, **cfg_fields) -> str:
    folder = save(tc, tmp_path / "tc")
    cfg = json.loads((folder / "cfg.json").read_text())
    for k, v in cfg_fields.items():
        if v is None:
            cfg.pop(k, None)
            cfg["metadata"].pop(k, None)
        elif k in cfg["metadata"]:
            cfg["metadata"][k] = v
        else:
            cfg[k] = v
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return str(folder)


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"apply_b_dec_to_input": True}, "apply_b_dec_to_input: must be false for a transcoder"),
        ({"hook_name_out": "blocks.1.hook_resid_mid"}, "hook_name_out: a transcoder here writes a later point"),
        ({"hook_name_out": "blocks.2.hook_mlp_out"}, "hook_name_out: a transcoder here writes a later point"),
        ({"hook_name_out": "blocks.1.hook_mlp_outt"}, "hook_name_out: unsupported hook"),
        ({"hook_name_out": None}, "hook_name_out: unsupported hook None"),
        ({"d_out": 64}, "W_dec has shape (192, 128), expected (192, 64)"),
        ({"architecture": "skip_transcoder"}, "a skip transcoder needs a 'W_skip' tensor"),
    ],
)
def test_bad_transcoder_folders_name_the_field(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load(_folder(tmp_path, _transcoder(4, 1), **fields))


def test_a_transcoder_reads_as_saved(tmp_path):
    tc = _transcoder(5, 2, skip=True)
    got = load(save(tc, tmp_path / "tc"))
    assert (got.point, got.out_point, got.layer, got.out_layer, got.architecture) == (
        "mlp_in",
        "mlp_out",
        2,
        2,
        "standard",
    )
    jump = _transcoder(6, 1, "jumprelu")
    assert json.loads((save(jump, tmp_path / "j") / "cfg.json").read_text())["architecture"] == "jumprelu_transcoder"
    assert load(tmp_path / "j").threshold is not None
    x = torch.randn(7, D, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(got.reconstruct(x), tc.reconstruct(x))
    f = got.encode(x)[0]
    assert torch.allclose(got.reconstruct(x), f @ tc.W_dec + tc.b_dec + x @ tc.W_skip.T, atol=1e-5)
