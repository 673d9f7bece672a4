"""A transcoder (mlp_in -> mlp_out of layer 2, the first layer of the second stage under PP=2) on the
session's TP=2 and PP=2 engines: its features (graph-safe) equal a torch encode of HF's mlp_in, and a clamp
(delta computed at mlp_in, added at mlp_out) equals HF with the edit by hand — encoded on one rank (TP
rank 0; the stage holding the layer), clamped on every TP rank and only on that stage."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.hook_fns import PROMPT
from support.reference import hf_model, point_activations
from support.saes import random_transcoder, ref_encode, worker_sae_counts
from vllm_worker.sae import save

LAYER = 2
TC = random_transcoder(31, LAYER)
FEATS, VALUES = [4, 17], [5.0, 0.0]


@pytest.fixture(scope="module", params=["tp2", "pp2"])
def llm(request, tmp_path_factory):
    llm = request.getfixturevalue(request.param)
    info = llm.load_sae("ptc", str(save(TC, tmp_path_factory.mktemp("tc") / "ptc")))
    assert (info["kind"], info["point"], info["out_point"]) == ("transcoder", "mlp_in", "mlp_out")
    return request.param, llm


def _counts(llm) -> list[dict]:
    return llm.collective_rpc(worker_sae_counts)


def test_transcoder_features_and_clamp_equal_hf(llm):
    kind, llm = llm
    hf = hf_model("llama")
    sps = [
        SamplingParams(
            max_tokens=4, temperature=0, ignore_eos=True, extra_args={"output_sae_features": {"sae": "ptc", "top_k": 6}}
        ),
        SamplingParams(
            max_tokens=4,
            temperature=0,
            ignore_eos=True,
            extra_args={
                "apply_sae_clamp": {"sae": "ptc", "features": FEATS, "values": VALUES},
                "output_activations": {"mlp_out": [LAYER], "resid_post": [3]},
            },
        ),
    ]
    before = _counts(llm)
    feats_out, clamp_out = llm.generate([PROMPT, PROMPT + " again"], sps, use_tqdm=False)
    after = _counts(llm)
    ids = list(feats_out.prompt_token_ids) + list(feats_out.outputs[0].token_ids)[:-1]
    ref = ref_encode(TC, point_activations(hf, "llama", ids)[0]["mlp_in"][LAYER])
    got = feats_out.activations["sae_features"]["ptc"]
    assert (got["values"] - ref.topk(6, dim=-1).values).abs().max() <= 1e-4

    seen: dict[str, torch.Tensor] = {}

    def clamp(where, layer, h):
        if layer != LAYER:
            return None
        if where == "mlp_in":
            f = ref_encode(TC, h)
            seen["delta"] = (torch.tensor(VALUES) - f[:, FEATS]) @ TC.W_dec[FEATS]
        return h + seen["delta"] if where == "mlp_out" else None

    ids = list(clamp_out.prompt_token_ids) + list(clamp_out.outputs[0].token_ids)[:-1]
    ref, logits = point_activations(hf, "llama", ids, clamp)
    a = clamp_out.activations
    assert (a["mlp_out"] - ref["mlp_out"][[LAYER]]).abs().max() <= 1e-4
    assert (a["resid_post"] - ref["resid_post"][[3]]).abs().max() <= 1e-4
    n = len(clamp_out.prompt_token_ids)
    assert logits[n - 1 :].argmax(-1).tolist() == list(clamp_out.outputs[0].token_ids)
    feat = [x["feature_rows"] - y["feature_rows"] for x, y in zip(after, before)]
    clamped = [x["clamp_rows"] - y["clamp_rows"] for x, y in zip(after, before)]
    n_pos = len(ids)
    assert feat[1 if kind == "pp2" else 0] > 0 and feat[0 if kind == "pp2" else 1] == 0, feat
    assert clamped == ([n_pos, n_pos] if kind == "tp2" else [0, n_pos]), clamped
