"""Tensor and pipeline parallelism (TP=2 / PP=2, two CPU worker processes each): capture, steering, hooks, persistent hooks and
`get_parameter` give the TP=1 / HF numbers; results come back once, not tp_size times."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.hook_fns import PROMPT, ablate, check_persistent_hooks, lens_top5
from support.reference import greedy, hf_model, residuals, steer_edit, zero_dim_edit
from vllm_worker import Hook, SteeringVector


def _equal_to_hf(out, v, steer_layer, dim, ablate_layers) -> torch.Tensor:
    """Same tokens and residuals as HF with the steering and ablation done by torch hooks."""
    edit = zero_dim_edit(dim, ablate_layers, steer_edit({steer_layer: v[0]}))
    hf = hf_model("llama")
    assert list(out.outputs[0].token_ids) == greedy(hf, list(out.prompt_token_ids), 5, edit)
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    ref, _ = residuals(hf, ids[:-1], edit)
    assert (out.activations["residual_stream"] - ref).abs().max() <= 1e-4
    return ref


def test_tp2_capture_steer_hook_and_logit_lens_equal_hf(tp2):
    assert [s["tp_rank"] for s in tp2.collective_rpc("lens_status")] == [0, 1]
    v = torch.randn(1, 128, generator=torch.Generator().manual_seed(5)) * 4
    sp = SamplingParams(
        max_tokens=5,
        temperature=0,
        ignore_eos=True,
        extra_args={
            "output_residual_stream": [0, 1, 2, 3],
            "apply_steering_vectors": [SteeringVector(v, [1])],
            "apply_hooks": [Hook(ablate(3), [2]), Hook(lens_top5, [3])],
        },
    )
    out = tp2.generate([PROMPT], sp, use_tqdm=False)[0]
    ref = _equal_to_hf(out, v, 1, 3, (2,))
    hf = hf_model("llama")
    saved = out.hook_results["1"]
    assert saved["w_shape"] == (512, 128)  # gathered across both shards
    assert len(saved["top"]) == 5  # once per step, not once per rank
    top = torch.cat(saved["top"])
    hf_top = (hf.model.norm(ref[3]) @ hf.lm_head.weight.T).topk(5, dim=-1).indices
    assert (top == hf_top).all()


def test_tp2_persistent_hooks(tp2):
    check_persistent_hooks(tp2)


def test_pp2_stages_merge_by_layer_and_equal_hf(pp2):
    assert [s["layers"] for s in pp2.collective_rpc("lens_status")] == [[0, 1], [2, 3]]
    v = torch.randn(1, 128, generator=torch.Generator().manual_seed(8)) * 4
    # a hook on stage 0 reading a parameter of the last stage needs a prefetch: a clear error first
    with pytest.raises(Exception, match="prefetch"):
        pp2.generate(
            [PROMPT], SamplingParams(max_tokens=2, extra_args={"apply_hooks": [Hook(lens_top5, [0])]}), use_tqdm=False
        )
    assert pp2.prefetch_params(["lm_head.weight", "model.norm.weight"]) == ["lm_head.weight", "model.norm.weight"]
    sp = SamplingParams(
        max_tokens=5,
        temperature=0,
        ignore_eos=True,
        extra_args={
            "output_residual_stream": [0, 1, 2, 3],
            "apply_steering_vectors": [SteeringVector(v, [2])],
            "apply_hooks": [Hook(ablate(5), [1, 3]), Hook(lens_top5, [0])],
        },
    )
    out = pp2.generate([PROMPT], sp, use_tqdm=False)[0]
    ref = _equal_to_hf(out, v, 2, 5, (1, 3))
    hf = hf_model("llama")
    # stage 0 saw layer 1, stage 1 saw layer 3: lists concatenated in stage (= layer) order
    assert out.hook_results["0"]["layers"] == [1] * 5 + [3] * 5
    top = torch.cat(out.hook_results["1"]["top"])
    hf_top = (hf.model.norm(ref[0]) @ hf.lm_head.weight.T).topk(5, dim=-1).indices
    assert (top == hf_top).all()
    pp2.clear_prefetched()


def _record_point(ctx, h):
    ctx.saved.setdefault("at", []).append((ctx.point, ctx.layer_idx, tuple(h.shape)))


@pytest.mark.parametrize("engine", ["tp2", "pp2"])
def test_hook_points_under_tp2_and_pp2_equal_hf(engine, request):
    """Inner points across ranks: attn_out / mlp_out are all-reduced before they reach the stream (every TP
    rank sees the whole value); under PP resid_pre of the first layer of stage 1 is the stream stage 0
    sent (resid_post of layer 1); steering at mlp_out on stage 1; z refused under TP (each rank holds a
    slice of the heads; mlp_post is gathered: test_neuron_points_parallel.py); a persistent hook at a point runs on its own stage."""
    from support.reference import point_activations

    llm = request.getfixturevalue(engine)
    v = torch.randn(1, 128, generator=torch.Generator().manual_seed(9)) * 3
    want = {
        "resid_pre": [0, 2],
        "attn_out": [1, 3],
        "resid_mid": [2],
        "mlp_in": [1, 2],
        "mlp_out": [0, 3],
        "resid_post": [1],
    }
    sp = SamplingParams(
        max_tokens=4,
        temperature=0,
        ignore_eos=True,
        extra_args={
            "output_activations": want,
            "apply_steering_vectors": [SteeringVector(v, [2], point="mlp_out")],
        },
    )
    out = llm.generate([PROMPT], sp, use_tqdm=False)[0]

    def edit(where, layer, h):
        return h + v[0] if (where, layer) == ("mlp_out", 2) else None

    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)[:-1]
    ref, _ = point_activations(hf_model("llama"), "llama", ids, edit)
    for p, layers in want.items():
        assert (out.activations[p] - ref[p][layers]).abs().max() <= 1e-4 * ref[p].abs().max(), p
    if engine == "tp2":
        with pytest.raises(ValueError, match="z under tensor parallelism"):
            llm.generate([PROMPT], SamplingParams(max_tokens=2, extra_args={"output_activations": {"z": [1]}}))
    llm.clear_hooks()
    llm.register_hooks([Hook(_record_point, [1, 3], point="attn_out")])
    llm.generate([PROMPT], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    (res,) = llm.collect_hook_results().values()
    assert sorted({(p, l) for p, l, _ in res["0"]["at"]}) == [("attn_out", 1), ("attn_out", 3)]
    llm.clear_hooks()


def test_pp2_one_vector_at_layers_of_both_stages_equal_hf(pp2):
    """Equal rows at layers of both stages cross as one row and its count (`spec._wire`), pickled by the
    multiprocess executor: each stage rebuilds its rows, and the numbers are HF's."""
    v = torch.randn(128, generator=torch.Generator().manual_seed(9)) * 4
    extra = {
        "output_residual_stream": [0, 1, 2, 3],
        "apply_steering_vectors": [SteeringVector(v.expand(2, 128), [1, 2])],
    }
    out = pp2.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, extra_args=extra))[0]
    edit = steer_edit({1: v, 2: v})
    hf = hf_model("llama")
    assert list(out.outputs[0].token_ids) == greedy(hf, list(out.prompt_token_ids), 5, edit)
    ref, _ = residuals(hf, list(out.prompt_token_ids) + list(out.outputs[0].token_ids)[:-1], edit)
    assert (out.activations["residual_stream"] - ref).abs().max() <= 1e-4
