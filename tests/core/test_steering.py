"""Steering equals the same addition done by a torch hook in HF; batch-mates are untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from vllm import SamplingParams

from support import TESTS
from support.engines import model_path
from support.reference import greedy, hf_model, residuals, steer_edit
from vllm_worker import SteeringVector

D = 128
PROMPTS = [
    "the water of people will come down to the side",
    "a long thing to see him",
    "they said the first people could",
    "how many water did she write",
    "the number of them was long",
    "all day we can find it",
    "his word was not the way",
    "she will look at the water",
]


def _vec(seed: int, shape=(1, D), norm=4.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(*shape, generator=g)
    return v / v.norm(dim=-1, keepdim=True) * norm


def _check_against_hf(out, layer_vecs, capture_layers, **kw):
    hf = hf_model("llama")
    edit = steer_edit(layer_vecs, **kw)
    prompt_ids = list(out.prompt_token_ids)
    assert list(out.outputs[0].token_ids) == greedy(hf, prompt_ids, len(out.outputs[0].token_ids), edit)
    ids = prompt_ids + list(out.outputs[0].token_ids)
    ref, _ = residuals(hf, ids[:-1], edit)
    acts = out.activations["residual_stream"]
    for i, layer in enumerate(capture_layers):
        err = (acts[i] - ref[layer]).abs().max().item()
        assert err <= 1e-4, f"layer {layer}: {err}"


def test_mixed_batch_of_8(llama):
    """Capture/steer on some requests; the others are token-identical to a run without the plugin."""
    v1, v5 = _vec(1, norm=6.0), _vec(5, norm=6.0)
    v6 = _vec(6, shape=(1, 2, D), norm=8.0)
    extra = {
        0: {"output_residual_stream": [0, 3]},
        1: {"apply_steering_vectors": [SteeringVector(v1, [1])], "output_residual_stream": [1, 2, 3]},
        3: {"output_residual_stream": [2]},
        5: {
            "apply_steering_vectors": [SteeringVector(v5, [2], scale=0.5, norm_match=True)],
            "output_residual_stream": [2, 3],
        },
        6: {
            "apply_steering_vectors": [SteeringVector(v6, [0], position_indices=[2, 4])],
            "output_residual_stream": [0, 3],
        },
    }
    sps = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, extra_args=extra.get(i)) for i in range(8)]
    outs = llama.generate(PROMPTS, sps, use_tqdm=False)

    env = dict(os.environ, VLLM_LENS_DISABLE="1")
    proc = subprocess.run(
        [sys.executable, str(TESTS / "support" / "plain_run.py"), str(model_path("llama")), json.dumps(PROMPTS), "8"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert line, proc.stderr[-3000:]
    plain = json.loads(line[0][7:])
    # VLLM_LENS_DISABLE=1 is a complete no-op: no extension, no output attribute
    assert plain["worker_extension_cls"] == "" and plain["has_activations_attr"] is False
    for i in (0, 2, 3, 4, 7):
        assert list(outs[i].outputs[0].token_ids) == plain["tokens"][i], f"request {i} changed"
    assert any(list(outs[i].outputs[0].token_ids) != plain["tokens"][i] for i in (1, 5, 6)), "steering had no effect"

    hf = hf_model("llama")
    for i in (0, 3):
        ids = list(outs[i].prompt_token_ids) + list(outs[i].outputs[0].token_ids)
        ref, _ = residuals(hf, ids[:-1])
        layers = extra[i]["output_residual_stream"]
        for j, layer in enumerate(layers):
            assert (outs[i].activations["residual_stream"][j] - ref[layer]).abs().max() <= 1e-4
    _check_against_hf(outs[1], {1: v1[0]}, [1, 2, 3])
    _check_against_hf(outs[5], {2: v5[0]}, [2, 3], scale=0.5, norm_match=True)
    _check_against_hf(outs[6], {0: v6[0]}, [0, 3], positions=[2, 4])


def test_3d_steering_once_at_prompt_position_k(llama):
    k = 3
    v = _vec(11, shape=(2, 1, D), norm=20.0)
    sv = SteeringVector(v, [0, 2], position_indices=[k])
    sp = SamplingParams(
        max_tokens=6,
        temperature=0,
        ignore_eos=True,
        extra_args={"apply_steering_vectors": [sv], "output_residual_stream": [0, 1, 2, 3]},
    )
    out = llama.generate([PROMPTS[0]], sp, use_tqdm=False)[0]
    _check_against_hf(out, {0: v[0], 2: v[1]}, [0, 1, 2, 3], positions=[k])
    # exactly once at k: the stream at every other position equals the unsteered one at layer 0
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    ref_plain, _ = residuals(hf_model("llama"), ids[:-1])
    diff = (out.activations["residual_stream"][0] - ref_plain[0]).abs().amax(dim=-1)
    assert diff[k] > 1.0 and diff[torch.arange(len(diff)) != k].max() <= 1e-4


def test_2d_steering_default_position_all_and_scale(llama):
    v = _vec(21, shape=(1, D), norm=3.0)
    sp = SamplingParams(
        max_tokens=5,
        temperature=0,
        ignore_eos=True,
        extra_args={"apply_steering_vectors": [SteeringVector(v, [-1], scale=2.0)], "output_residual_stream": [3]},
    )
    out = llama.generate([PROMPTS[2]], sp, use_tqdm=False)[0]
    _check_against_hf(out, {3: v[0]}, [3], scale=2.0)


def test_rows_cross_as_views_in_process_and_equal_hf(llama):
    """One in-process worker (the `uni` executor): rows travel as `compat.raw_view` (here, in-process, the
    worker reads the `Ext` itself; tests/unit/test_ipc_rows.py: across vLLM's IPC) and steer as bytes did."""
    from vllm_worker import compat
    from vllm_worker.frontend.state import engine_state

    v = _vec(23, shape=(2, D), norm=3.0)
    sp = SamplingParams(
        max_tokens=5,
        temperature=0,
        ignore_eos=True,
        extra_args={"apply_steering_vectors": [SteeringVector(v, [1, 2])], "output_residual_stream": [1, 3]},
    )
    out = llama.generate([PROMPTS[4]], sp, use_tqdm=False)[0]
    assert engine_state(compat.processor_of_llm(llama)).rows_by_view is True
    _check_against_hf(out, {1: v[0], 2: v[1]}, [1, 3])


def test_caller_objects_are_never_mutated(llama):
    v = _vec(31, norm=6.0)
    v_before = v.clone()
    sv = SteeringVector(v, [1])
    args = {"apply_steering_vectors": [sv], "output_residual_stream": [1]}
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, extra_args=args)
    a = llama.generate([PROMPTS[1]], sp, use_tqdm=False)[0]
    b = llama.generate([PROMPTS[1]], sp, use_tqdm=False)[0]
    assert sp.extra_args is args and list(args) == ["apply_steering_vectors", "output_residual_stream"]
    assert args["apply_steering_vectors"][0] is sv and torch.equal(v, v_before)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert torch.equal(a.activations["residual_stream"], b.activations["residual_stream"])
    plain = llama.generate(
        [PROMPTS[1]],
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, extra_args={"output_residual_stream": [1]}),
        use_tqdm=False,
    )[0]
    assert not torch.equal(a.activations["residual_stream"], plain.activations["residual_stream"])


def test_pydantic_shapes_round_trip_and_steer_the_same(llama):
    """`model_dump()` (JSON-able) -> `model_validate` gives an equal vector; the dump itself is an accepted
    request form; `model_copy(update=...)` makes a variant; the object is frozen."""
    import json

    import pydantic

    sv = SteeringVector(_vec(41, shape=(1, 2, D), norm=9.0), [1], scale=0.5, norm_match=True, position_indices=[1, 3])
    dumped = json.loads(json.dumps(sv.model_dump()))
    assert SteeringVector.model_validate(dumped) == sv
    with pytest.raises(pydantic.ValidationError):
        sv.scale = 2.0
    assert sv.model_copy(update={"scale": 2.0}).scale == 2.0 and sv.scale == 0.5

    def run(vec):
        sp = SamplingParams(
            max_tokens=4,
            temperature=0,
            ignore_eos=True,
            extra_args={"apply_steering_vectors": [vec], "output_residual_stream": [1, 3]},
        )
        return llama.generate([PROMPTS[0]], sp, use_tqdm=False)[0]

    a, b = run(sv), run(dumped)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert torch.equal(a.activations["residual_stream"], b.activations["residual_stream"])
    _check_against_hf(a, {1: sv.activations[0]}, [1, 3], scale=0.5, norm_match=True, positions=[1, 3])


def test_hook_round_trips_through_model_dump(llama):
    from vllm_worker import Hook

    def double(ctx, h):
        ctx.saved["n"] = ctx.saved.get("n", 0) + 1
        return h * 2

    hook = Hook(double, [1])
    again = Hook.model_validate(json.loads(json.dumps(hook.model_dump())))
    sps = [
        SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, extra_args={"apply_hooks": [h]})
        for h in (hook, again)
    ]
    a, b = llama.generate([PROMPTS[1], PROMPTS[1]], sps, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.hook_results == b.hook_results


def test_requests_alternating_two_vectors_from_admission_templates_equal_hf(llama):
    """Eight requests alternating between two steering vectors (equal fields, different bytes), twice: the
    second batch is admitted from admission templates (`admit_templates`, kept per content), and every
    request still steers with its own vector, token for token and activation for activation as HF does."""
    va, vb = _vec(11, norm=6.0), _vec(12, norm=6.0)
    rt = llama.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner._lens_runtime
    hits = rt.admission.templates.hits
    for _ in range(2):
        vecs = [va if i % 2 else vb for i in range(8)]
        sps = [
            SamplingParams(
                max_tokens=6,
                temperature=0,
                ignore_eos=True,
                extra_args={
                    "apply_steering_vectors": [SteeringVector(v.clone(), [1])],
                    "output_residual_stream": [1, 3],
                },
            )
            for v in vecs
        ]
        outs = llama.generate(PROMPTS, sps, use_tqdm=False)
        for out, v in zip(outs, vecs):
            _check_against_hf(out, {1: v[0]}, [1, 3])
    assert rt.admission.templates.hits - hits >= 8  # (the second batch: every request from its template)
