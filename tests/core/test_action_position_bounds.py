"""A probe action's watched positions beyond what the workers hold (int64 on the device) are refused when
the request is validated, naming the field: admitted, such a position failed the step's one flush of the
action table (`ActionTable.flush`), and with it every batch-mate admitted in that step with steering or
actions (review3). Batch-mates keep HF float32's numbers."""

from __future__ import annotations

import json
import re

import pytest
import torch
from vllm import SamplingParams

from support.reference import greedy, hf_model, steer_edit
from vllm_worker import HookError, SteeringVector

D = 128
PROMPTS = ["the water of people will come down to the side", "a long thing to see him"]
N_NEW = 6


def _unit(seed: int) -> torch.Tensor:
    v = torch.randn(D, generator=torch.Generator().manual_seed(seed))
    return v / v.norm()


def _sp(extra=None) -> SamplingParams:
    return SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True, extra_args=extra)


def _steered(llama, prompt: str, steer: torch.Tensor) -> list[int]:
    sv = SteeringVector(activations=steer.view(1, D), layer_indices=[1], scale=4.0)
    out = llama.generate([prompt], [_sp({"apply_steering_vectors": [sv]})], use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


@pytest.mark.parametrize(
    "positions, field",
    [
        ([2**63], r"probe_actions\[0\]\.positions\[0\]"),
        ([3, 2**64 - 1], r"probe_actions\[0\]\.positions\[1\]"),
        ({"start": 2**63}, r"probe_actions\[0\]\.positions\.start"),
        ({"start": 2, "end": 2**63 + 9}, r"probe_actions\[0\]\.positions\.end"),
        ([{"start": 1, "end": 4}, {"start": 2**62}], r"probe_actions\[0\]\.positions\[1\]\.start"),
    ],
)
def test_a_position_past_the_workers_range_is_refused_and_no_batch_mate_fails(llama, positions, field):
    steer = _unit(7) * 6.0
    hf = hf_model("llama")
    prompt_ids = list(llama.get_tokenizer()(PROMPTS[1]).input_ids)
    want = greedy(hf, prompt_ids, N_NEW, steer_edit({1: steer}, 4.0))
    act = {"direction": _unit(3).tolist(), "layer": 2, "threshold": 1e6, "then": "stop", "positions": positions}
    sv = SteeringVector(activations=steer.view(1, D), layer_indices=[1], scale=4.0)
    try:
        llama.generate(PROMPTS, [_sp({"probe_actions": [act]}), _sp({"apply_steering_vectors": [sv]})], use_tqdm=False)
    except HookError as e:  # (before the bound: the batch-mate failed with the bad request's flush)
        errs = [o.hook_error for o in e.outputs]
        pytest.fail(f"a batch-mate failed with the bad request: {errs}")
    except ValueError as e:
        assert re.search(field, str(e)), str(e)
    else:
        pytest.fail("a position past the workers' range was admitted")
    assert _steered(llama, PROMPTS[1], steer) == want  # (the engine goes on, equal to HF float32)


def test_the_largest_position_allowed_is_admitted(llama):
    """Positions just below the bound are legal: never reached, the request runs as without the action;
    a range from 0 to the bound watches every position and fires (threshold -1e6) as "all" does."""
    from vllm_worker.frontend.actions import MAX_POSITION

    act = {"direction": _unit(3).tolist(), "layer": 2, "threshold": -1e6, "then": "stop"}
    plain = llama.generate([PROMPTS[0]], [_sp()], use_tqdm=False)[0]
    for positions in ([MAX_POSITION - 1], {"start": MAX_POSITION - 1}):
        got = llama.generate([PROMPTS[0]], [_sp({"probe_actions": [{**act, "positions": positions}]})], use_tqdm=False)
        assert list(got[0].outputs[0].token_ids) == list(plain.outputs[0].token_ids), positions
        assert not got[0].activations["probe_actions"][0]["fired"], positions
    outs = [
        llama.generate([PROMPTS[0]], [_sp({"probe_actions": [{**act, "positions": p}]})], use_tqdm=False)[0]
        for p in ({"start": 0, "end": MAX_POSITION}, "all")
    ]
    reps = [o.activations["probe_actions"][0] for o in outs]
    assert reps[0]["fired"] and reps[0] == reps[1]
    assert [list(o.outputs[0].token_ids) for o in outs][0] == list(outs[1].outputs[0].token_ids)


def test_a_direction_value_past_a_float_is_refused_naming_the_field(llama):
    """An int too large for a float in `direction` (JSON allows it, and in a JSON string — as `vllm_xargs`
    carries it — vLLM's 64-bit check of extra_args never sees it) is a ValueError naming the field, not an
    OverflowError out of validation (an HTTP 500)."""
    act = {"direction": [10**400] + [0.0] * (D - 1), "layer": 2, "threshold": 1.0, "then": "stop"}
    with pytest.raises(ValueError, match=r"probe_actions\[0\]\.direction"):
        llama.generate([PROMPTS[0]], [_sp({"probe_actions": json.dumps([act])})], use_tqdm=False)
    out = llama.generate([PROMPTS[0]], [_sp()], use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == N_NEW
