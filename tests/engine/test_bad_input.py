"""Bad input: a ValueError naming the field, for that call only; the engine keeps serving."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.reference import held_results
from vllm_worker import SteeringVector

PROMPT = "the water of people will come"
D = 128


def _sp(**extra):
    return SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args=extra)


BAD = [
    ({"output_residual_stream": [99]}, "output_residual_stream: layer 99 is out of range"),
    ({"output_residual_stream": [-5]}, "output_residual_stream: layer -5 is out of range"),
    ({"output_residual_stream": "3"}, "output_residual_stream"),
    ({"output_residual_stream": []}, "output_residual_stream"),
    ({"output_residual_stream": [1.5]}, "output_residual_stream"),
    (
        {"apply_steering_vectors": [SteeringVector(torch.ones(1, D + 1), [0])]},
        r"apply_steering_vectors[0].activations: last dimension 129 != d_model 128",
    ),
    (
        {"apply_steering_vectors": [SteeringVector(torch.ones(D), [0])]},
        "apply_steering_vectors[0].activations: expected 2-D",
    ),
    (
        {"apply_steering_vectors": [SteeringVector(torch.ones(1, 1, 1, D), [0])]},
        "apply_steering_vectors[0].activations",
    ),
    ({"apply_steering_vectors": [SteeringVector(torch.ones(2, D), [0])]}, "len(layer_indices)"),
    (
        {"apply_steering_vectors": [SteeringVector(torch.full((1, D), float("nan")), [0])]},
        "apply_steering_vectors[0].activations: contains NaN or inf",
    ),
    ({"apply_steering_vectors": [SteeringVector(torch.full((1, D), float("inf")), [0])]}, "NaN or inf"),
    ({"apply_steering_vectors": [SteeringVector(torch.ones(1, D), [7])]}, "apply_steering_vectors[0].layer_indices"),
    (
        {"apply_steering_vectors": [SteeringVector(torch.ones(1, 1, D), [0], position_indices=[50])]},
        "apply_steering_vectors[0].position_indices: position 50 is past the prompt",
    ),
    (
        {"apply_steering_vectors": [{"activations": torch.ones(1, D), "layer_indices": [0], "scale": float("nan")}]},
        "apply_steering_vectors[0].scale",
    ),
    ({"apply_steering_vectors": ["not a vector"]}, "apply_steering_vectors[0]: expected a SteeringVector"),
    ({"output_residual_streams": [0]}, "extra_args.output_residual_streams: unknown inspect-lens key"),
    ({"output_residual_stream": [True]}, "output_residual_stream: layer indices must be ints"),
    ({"output_residual_stream": False}, "output_residual_stream"),
    ({"output_residual_stream": "[1, 99]"}, "output_residual_stream: layer 99 is out of range"),
    (
        {"apply_steering_vectors": [{"activations": torch.ones(1, D), "layer_indices": [0], "scale": float("inf")}]},
        "apply_steering_vectors[0].scale: expected a finite number",
    ),
    ({"apply_steering_vector": []}, "extra_args.apply_steering_vector: unknown inspect-lens key"),
]


@pytest.fixture(scope="module")
def baseline(llama):
    return list(llama.generate([PROMPT], _sp(), use_tqdm=False)[0].outputs[0].token_ids)


@pytest.mark.parametrize("extra,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_a_clear_error_and_engine_keeps_serving(llama, baseline, extra, message):
    with pytest.raises(ValueError) as exc:
        llama.generate([PROMPT], _sp(**extra), use_tqdm=False)
    assert message in str(exc.value)
    assert not llama.llm_engine.has_unfinished_requests()
    ok = llama.generate([PROMPT], _sp(output_residual_stream=[0]), use_tqdm=False)[0]
    assert list(ok.outputs[0].token_ids) == baseline
    assert ok.activations["residual_stream"].shape[1] == len(ok.prompt_token_ids) + 3


def test_bad_request_in_a_list_aborts_only_that_call(llama, baseline):
    with pytest.raises(ValueError, match="output_residual_stream"):
        llama.generate(
            [PROMPT, PROMPT], [_sp(output_residual_stream=[0]), _sp(output_residual_stream=[42])], use_tqdm=False
        )
    assert not llama.llm_engine.has_unfinished_requests()
    outs = llama.generate([PROMPT, PROMPT], [_sp(output_residual_stream=[0]), _sp()], use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [baseline, baseline]
    assert outs[0].activations is not None and outs[1].activations is None


def test_requests_aborted_by_a_later_bad_one_leave_nothing_behind(llama):
    """A bad request later in the same offline list aborts the ones already added: their pending entries
    and worker stores are released (nothing waits for a fetch that never comes)."""
    from vllm_worker import compat, frontend

    proc = compat.processor_of_llm(llama)
    held, _ = held_results(llama)
    with pytest.raises(ValueError, match="out of range"):
        llama.generate(
            [PROMPT, PROMPT, PROMPT],
            [_sp(output_residual_stream=[0]), _sp(output_residual_stream=[1]), _sp(output_residual_stream=[99])],
            use_tqdm=False,
        )
    assert frontend.pending_count(proc) == 0
    status = llama.collective_rpc("lens_status")[0]
    assert status["stored_requests"] == 0
    assert held_results(llama) == (held, 0)  # nothing announced to the result pool is left either
    out = llama.generate([PROMPT], _sp(output_residual_stream=[0]), use_tqdm=False)[0]
    assert out.activations["residual_stream"].shape[0] == 1
    assert held_results(llama) == (held + 1, 0)
    del out
    assert held_results(llama) == (held, 0)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(activations=torch.ones(1, D), layer_indices=[0], scale=float("nan")), "scale"),
        (dict(activations=torch.ones(1, D), layer_indices=[0], scale=10**400), "scale"),
        (dict(activations=torch.ones(1, D), layer_indices=[True]), "layer_indices"),
        (dict(activations=torch.ones(1, D), layer_indices=[]), "layer_indices"),
        (dict(activations=[[1.0] * D], layer_indices=[0]), "activations"),
        (dict(activations=torch.ones(1, D, dtype=torch.long), layer_indices=[0]), "activations"),
        (dict(activations=torch.ones(1, D), layer_indices=[0], norm_match=1), "norm_match"),
        (dict(activations=torch.ones(1, 2, D), layer_indices=[0], position_indices=["a", "b"]), "position_indices"),
    ],
)
def test_steering_vector_type_errors_name_the_field_where_it_is_made(kwargs, field):
    """Type errors surface when the object is made (a pydantic ValidationError is a ValueError)."""
    with pytest.raises(ValueError, match=field):
        SteeringVector(**kwargs)


def test_hook_type_errors_name_the_field_where_they_are_made():
    from vllm_worker import Hook

    with pytest.raises(ValueError, match="fn"):
        Hook(42, [0])
    with pytest.raises(ValueError, match="layer_indices"):
        Hook(lambda ctx, h: None, [1.5])
    with pytest.raises(ValueError, match="pre"):
        Hook(lambda ctx, h: None, [0], pre="yes")
