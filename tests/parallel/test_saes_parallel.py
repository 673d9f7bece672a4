"""SAEs under tensor parallelism (TP=2) and pipeline parallelism (PP=2, the SAE's layer on the second
stage), on the session's parallel engines (shared with test_parallel.py): features (top_k, graph-safe),
feature steering and clamping (Python path) equal the HF reference, and the work is done where it must be
— features encoded on one rank only (TP rank 0; the stage holding the layer), clamps on every TP rank (the
stream is replicated) and only on the stage holding the layer."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.hook_fns import PROMPT
from support.reference import greedy, hf_model, residuals, steer_edit
from support.saes import random_sae, ref_clamp, ref_encode, save_with, worker_sae_counts

LAYER = 2  # under PP=2 the first layer of the second stage
SAE = random_sae(21, "resid_post", LAYER, "standard", normalize="layer_norm")
FEATS, VALUES = [3, 11], [20.0, 0.0]


@pytest.fixture(scope="module", params=["tp2", "pp2"])
def llm(request, tmp_path_factory):
    llm = request.getfixturevalue(request.param)
    info = llm.load_sae("par", save_with(SAE, tmp_path_factory.mktemp("sae") / "par"))
    assert (info["layer"], info["point"]) == (LAYER, "resid_post")
    return request.param, llm


def _work(llm, fn) -> tuple[list[int], list[int], object]:
    """(feature rows, clamp rows) each rank encoded while `fn` ran, and what it returned."""
    before = llm.collective_rpc(worker_sae_counts)
    got = fn()
    after = llm.collective_rpc(worker_sae_counts)
    feat = [a["feature_rows"] - b["feature_rows"] for a, b in zip(after, before)]
    clamp = [a["clamp_rows"] - b["clamp_rows"] for a, b in zip(after, before)]
    return feat, clamp, got


def _sp(n: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, extra_args=extra)


def _tokens(out) -> list[int]:
    return list(out.prompt_token_ids) + list(out.outputs[0].token_ids)


def test_features_and_steering_equal_hf(llm):
    """Graph-safe path: top_k features of one request and feature steering of its batch-mate."""
    kind, llm = llm
    hf = hf_model("llama")
    sps = [
        _sp(5, output_sae_features={"sae": "par", "top_k": 8}),
        _sp(
            5,
            apply_sae_steering={"sae": "par", "features": [3, 7], "scale": [6.0, -4.0]},
            output_residual_stream=[2, 3],
        ),
    ]
    feat, clamp, outs = _work(llm, lambda: llm.generate([PROMPT, PROMPT + " again"], sps, use_tqdm=False))
    ids = _tokens(outs[0])
    n_pos = len(ids) - 1
    assert list(outs[0].outputs[0].token_ids) == greedy(hf, list(outs[0].prompt_token_ids), 5)
    got = outs[0].activations["sae_features"]["par"]
    ref = ref_encode(SAE, residuals(hf, ids[:-1])[0][LAYER])
    assert torch.equal(got["positions"], torch.arange(n_pos))
    assert got["values"].shape == got["indices"].shape == (n_pos, 8)
    assert (got["values"] - ref.topk(8, dim=-1).values).abs().max() <= 1e-4
    assert (ref.gather(1, got["indices"]) - got["values"]).abs().max() <= 1e-4
    # encoded once, on the reporting rank (TP rank 0) / the stage holding the layer (PP: the second)
    assert feat == ([n_pos, 0] if kind == "tp2" else [0, n_pos]) and clamp == [0, 0]

    edit = steer_edit({LAYER: 6.0 * SAE.W_dec[3] - 4.0 * SAE.W_dec[7]})
    prompt = list(outs[1].prompt_token_ids)
    assert list(outs[1].outputs[0].token_ids) == greedy(hf, prompt, 5, edit)
    ref, _ = residuals(hf, _tokens(outs[1])[:-1], edit)
    assert (outs[1].activations["residual_stream"] - ref[[2, 3]]).abs().max() <= 1e-4
    assert outs[1].activations.get("sae_features") is None


def test_clamping_equals_hf(llm):
    """Python path: the clamp runs on every TP rank (each holds the whole stream) and only on the stage
    holding the layer; features read from the clamped stream come back once."""
    kind, llm = llm
    hf = hf_model("llama")

    def clamp(layer: int, h: torch.Tensor):
        return ref_clamp(SAE, h[0], FEATS, VALUES).unsqueeze(0) if layer == LAYER else None

    sp = _sp(
        6,
        apply_sae_clamp={"sae": "par", "features": FEATS, "values": VALUES},
        output_sae_features={"sae": "par", "features": FEATS},
    )
    feat, clamp_rows, (out,) = _work(llm, lambda: llm.generate([PROMPT], sp, use_tqdm=False))
    prompt = list(out.prompt_token_ids)
    assert list(out.outputs[0].token_ids) == greedy(hf, prompt, 6, clamp)
    assert list(out.outputs[0].token_ids) != greedy(hf, prompt, 6), "the clamp changed nothing"
    n_pos = len(_tokens(out)) - 1
    got = out.activations["sae_features"]["par"]
    ref = ref_encode(SAE, residuals(hf, _tokens(out)[:-1], clamp)[0][LAYER])[:, FEATS]
    assert got["indices"].tolist() == FEATS and got["values"].shape == (n_pos, 2)
    assert (got["values"] - ref).abs().max() <= 1e-4
    assert feat == ([n_pos, 0] if kind == "tp2" else [0, n_pos])
    assert clamp_rows == ([n_pos, n_pos] if kind == "tp2" else [0, n_pos])
    assert all(s["stored_requests"] == 0 for s in llm.collective_rpc("lens_status"))
