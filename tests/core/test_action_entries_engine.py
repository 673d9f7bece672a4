"""A request sent to the Python path after admission (mlp_post work the kernel cannot do: a hook at the
tap before its pieces' capture) gives its steering entries back; its probe action then gates none of them
(review3). Before, the action went on copying its gate (0: never fired) into them every step, and a
batch-mate admitted next, whose plain steering took the same entry, ran unsteered once the first request
had left. The batch-mate's stream equals HF float32 steered by hand."""

from __future__ import annotations

import torch
from vllm import SamplingParams

from support.reference import hf_model, residuals, steer_edit
from vllm_worker import Hook, SteeringVector

D = 128
PROMPTS = ["the water of people will come down to the side", "a long thing to see him"]


def _unit(seed: int) -> torch.Tensor:
    v = torch.randn(D, generator=torch.Generator().manual_seed(seed))
    return v / v.norm()


def _noop(ctx, h):  # (a hook at mlp_post: returns nothing, changes nothing)
    return None


def test_a_batch_mate_keeps_its_steering_when_an_action_request_goes_to_the_python_path(llama):
    gated = SteeringVector(activations=(_unit(1) * 5.0).view(1, D), layer_indices=[1], scale=1.0)
    act = {"direction": _unit(2).tolist(), "layer": 2, "threshold": 1e6, "then": {"steer": gated}}
    x = SamplingParams(
        max_tokens=2,
        temperature=0,
        ignore_eos=True,
        extra_args={
            "probe_actions": [act],
            "output_activations": {"mlp_post": [0]},
            "apply_hooks": [Hook(_noop, [0], point="mlp_post")],
        },
    )
    steer = _unit(7) * 6.0
    y = SamplingParams(
        max_tokens=8,
        temperature=0,
        ignore_eos=True,
        extra_args={
            "apply_steering_vectors": [SteeringVector(activations=steer.view(1, D), layer_indices=[1], scale=1.0)],
            "output_residual_stream": [1, 3],
        },
    )
    outs = llama.generate(PROMPTS, [x, y], use_tqdm=False)
    assert not outs[0].activations["probe_actions"][0]["fired"]
    out = outs[1]
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    ref, _ = residuals(hf_model("llama"), ids[:-1], steer_edit({1: steer}))
    got = out.activations["residual_stream"]
    err = (got - ref[[1, 3]]).abs().amax(dim=(0, 2))  # (per position)
    assert err.max().item() <= 1e-4 * max(1.0, ref.abs().max().item()), err.tolist()
