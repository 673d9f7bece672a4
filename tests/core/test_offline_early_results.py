"""`LLM.generate` hands each request its results at the step it finishes (`VLLM_LENS_OFFLINE_EARLY_RESULTS`,
on by default), while the others still generate: the same results as fetching them all at the end of the
call (bitwise, and HF's at prompt and generated positions), a fetch per step in which requests finished, and
every failure still raised at the call's end with all of its outputs."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.reference import held_results, hf_model, residuals
from vllm_worker import HookError, SteeringVector
from vllm_worker.counters import FRONTEND_TIMINGS
from vllm_worker.frontend import fetch as frontend_fetch
from vllm_worker.frontend.state import engine_state
from vllm_worker.worker import faults

PROMPTS = ["the water of people will come down", "a long thing to see him", "they said the first", "how many"]
LENGTHS = [2, 5, 9, 5]  # three steps at which requests finish


def _params() -> list[SamplingParams]:
    v = torch.randn(1, 128, generator=torch.Generator().manual_seed(3)) * 4
    extra = [
        {"output_residual_stream": [0, 2]},
        {"output_residual_stream": [1], "apply_steering_vectors": [SteeringVector(v, [1])]},
        {"output_residual_stream": [3]},
        None,  # plain
    ]
    return [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, extra_args=e) for n, e in zip(LENGTHS, extra)]


def _run(llm, monkeypatch, early: bool) -> tuple[list, int]:
    monkeypatch.setenv("VLLM_LENS_OFFLINE_EARLY_RESULTS", "1" if early else "0")
    before = FRONTEND_TIMINGS["early_fetches"]
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    return outs, FRONTEND_TIMINGS["early_fetches"] - before


def test_results_at_the_finishing_step_equal_those_fetched_at_the_end_and_hf(llama, monkeypatch):
    early, fetches = _run(llama, monkeypatch, True)
    assert fetches == 3  # one fetch at each step where requests finished; nothing left for the end
    late, none = _run(llama, monkeypatch, False)
    assert none == 0
    for a, b in zip(early, late):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if b.activations is None:
            assert a.activations is None  # the plain request
            continue
        assert a.activations.keys() == b.activations.keys()
        assert torch.equal(a.activations["residual_stream"], b.activations["residual_stream"])
    # and HF's residuals at prompt and generated positions (the unsteered requests)
    for i, layers in ((0, [0, 2]), (2, [3])):
        o = early[i]
        ids = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        ref, _ = residuals(hf_model("llama"), ids[:-1])
        got = o.activations["residual_stream"]
        assert got.shape[1] == len(ids) - 1
        for j, layer in enumerate(layers):
            assert (got[j] - ref[layer]).abs().max() <= 1e-4


def test_a_failure_at_an_early_fetch_is_raised_at_the_end_with_every_output(llama, monkeypatch):
    monkeypatch.setenv("VLLM_LENS_OFFLINE_EARLY_RESULTS", "1")
    clean = llama.generate(PROMPTS, _params(), use_tqdm=False)
    held, _ = held_results(llama)  # (`clean`'s results among them)
    monkeypatch.setattr(faults, "STAGE", "assemble")  # the workers' assembly fails every capture's fetch
    with pytest.raises(HookError) as info:
        llama.generate(PROMPTS, _params(), use_tqdm=False)
    monkeypatch.setattr(faults, "STAGE", None)
    outs = info.value.outputs
    assert len(outs) == len(PROMPTS)
    assert {i for i, o in enumerate(outs) if o.hook_error is not None} == {0, 1, 2}
    assert all("injected" in outs[i].hook_error for i in (0, 1, 2))
    assert outs[3].outputs[0].token_ids == clean[3].outputs[0].token_ids and outs[3].hook_error is None
    assert engine_state(llama).early_failures == {}  # nothing carried into the next call
    del outs, info
    assert held_results(llama) == (held, 0)
    again = llama.generate(PROMPTS, _params(), use_tqdm=False)
    assert torch.equal(again[0].activations["residual_stream"], clean[0].activations["residual_stream"])


def test_an_early_fetch_that_raises_fails_its_requests_only_and_at_the_end(llama, monkeypatch):
    monkeypatch.setenv("VLLM_LENS_OFFLINE_EARLY_RESULTS", "1")
    clean = llama.generate(PROMPTS, _params(), use_tqdm=False)
    real, calls = frontend_fetch._fetch, []

    def broken_first(engine, todo):
        calls.append([p.key for p, _ in todo])
        if len(calls) == 1:
            raise ConnectionError("worker went away")
        return real(engine, todo)

    monkeypatch.setattr(frontend_fetch, "_fetch", broken_first)
    with pytest.raises(HookError) as info:
        llama.generate(PROMPTS, _params(), use_tqdm=False)
    monkeypatch.setattr(frontend_fetch, "_fetch", real)
    outs = info.value.outputs
    assert info.value.internal
    assert outs[0].hook_error is not None and "ConnectionError" in outs[0].hook_error  # finished first (2 tokens)
    assert outs[0].activations is None
    # the requests that finished later got their results, equal to a clean run's
    for i in (1, 2):
        assert outs[i].hook_error is None
        assert torch.equal(outs[i].activations["residual_stream"], clean[i].activations["residual_stream"])
    assert outs[3].hook_error is None and outs[3].outputs[0].token_ids == clean[3].outputs[0].token_ids
    # what the workers held for the request whose fetch failed went too
    assert llama.collective_rpc("lens_status")[0]["stored_requests"] == 0
