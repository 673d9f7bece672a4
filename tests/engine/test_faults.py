"""A bug in our own per-step code fails the requests it hit — with a clear error naming the stage — and
never the engine or a batch-mate: proven by injecting a failure at each stage (`vllm_worker.worker.faults`)."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.reference import held_results, hf_model, residuals
from vllm_worker import Hook, HookError, SteeringVector
from vllm_worker.worker import faults

PROMPTS = [
    "the water of people will come down to the side",
    "a long thing to see him",
    "they said the first people could",
    "how many water did she write",
]


def _noop(ctx, h):
    return None


def _batch(with_hook: bool = True):
    """Capture, plain, steering-only and (with_hook) a capture + Python hook request: with the hook the
    batch's steps take the Python path, without it the graph-safe one."""
    v = torch.randn(1, 128, generator=torch.Generator().manual_seed(5)) * 4
    extra = [{"output_residual_stream": [0, 2]}, None, {"apply_steering_vectors": [SteeringVector(v, [1])]}]
    if with_hook:
        extra.append({"output_residual_stream": [3], "apply_hooks": [Hook(_noop, [1])]})
    return [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args=e) for e in extra]


# stage -> (batch with the hook request?, the requests it fails): a failure hits the requests its stage
# was serving — all lens requests of the step for admission/planning/step work, the capturing ones for
# filing and assembly — and never the plain one
HIT = {
    "admission": (True, {0, 2, 3}),
    "flush": (True, {2}),  # the request whose steering was being moved to the device
    "plan": (True, {0, 2, 3}),
    "fill": (False, {0, 2}),
    "tap": (True, {0, 2, 3}),
    "kernel": (False, {0, 2}),
    "file": (True, {0, 3}),
    "assemble": (True, {0, 3}),
}


@pytest.mark.parametrize("stage", faults.STAGES)
def test_a_fault_in_our_code_fails_only_the_requests_it_hits(llama, stage, monkeypatch):
    baseline = llama.generate(PROMPTS[1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)[
        0
    ]
    with_hook, hit = HIT[stage]
    held, _ = held_results(llama)
    batch = _batch(with_hook)
    monkeypatch.setattr(faults, "STAGE", stage)
    with pytest.raises(HookError) as info:
        llama.generate(PROMPTS[: len(batch)], batch, use_tqdm=False)
    monkeypatch.setattr(faults, "STAGE", None)
    outs = info.value.outputs
    assert {i for i, o in enumerate(outs) if o.hook_error is not None} == hit
    for i in hit:
        assert "inspect-lens internal error" in outs[i].hook_error and "injected" in outs[i].hook_error
    # the plain batch-mate got exactly its solo tokens
    assert outs[1].outputs[0].token_ids == baseline.outputs[0].token_ids and outs[1].hook_error is None
    status = llama.collective_rpc("lens_status")[0]
    assert status["stored_requests"] == 0
    del outs, info
    assert held_results(llama) == (held, 0)  # failed requests' result memory went back too
    # and the engine serves the next capture exactly
    ok = llama.generate([PROMPTS[0]], _batch()[0], use_tqdm=False)[0]
    ids = list(ok.prompt_token_ids) + list(ok.outputs[0].token_ids)
    ref, _ = residuals(hf_model("llama"), ids[:-1])
    acts = ok.activations["residual_stream"]
    assert (acts[0] - ref[0]).abs().max() <= 1e-4 and (acts[1] - ref[2]).abs().max() <= 1e-4


def test_a_model_whose_layers_cannot_be_found_serves_plain_requests_and_refuses_features(llama, monkeypatch):
    """An unknown layout (here: the decoder-layer lookup fails at load) must never stop a model from being
    served: plain requests run as without the plugin, feature requests get one clear error naming the model
    class — and the engine goes on serving."""
    from support.engines import make_engine

    monkeypatch.setattr(faults, "STAGE", "layout")
    llm = make_engine("llama", max_num_seqs=5)  # an engine of its own, loaded under the fault
    monkeypatch.setattr(faults, "STAGE", None)
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ref = llama.generate(PROMPTS[0], plain, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate(PROMPTS[0], plain, use_tqdm=False)[0].outputs[0].token_ids == ref
    status = llm.collective_rpc("lens_status")[0]
    assert "fault injected at load" in status["unsupported"] and status["model_class"] == "LlamaForCausalLM"
    # every worker RPC answers on such a model: nothing stored to drop or free, features refused by kind
    assert llm.collective_rpc("lens_drop", args=(["x"],)) == [0]
    assert llm.collective_rpc("lens_release", args=([],)) == [0]
    assert llm.collective_rpc("lens_clear_hook_results") == [None]
    assert llm.collective_rpc("lens_clear_prefetched") == [None]
    assert "pool" not in llm.collective_rpc("lens_rusage")[0]
    report = llm.collective_rpc("lens_prefetch", args=(["lm_head.weight"], True))[0]
    assert report["error"]["kind"] == "unsupported" and "LlamaForCausalLM" in report["error"]["message"]
    for extra in (
        {"output_residual_stream": [1]},
        {"apply_steering_vectors": [SteeringVector(torch.ones(1, 128), [1])]},
    ):
        sp = SamplingParams(max_tokens=2, temperature=0, extra_args=extra)
        with pytest.raises(ValueError, match="LlamaForCausalLM: inspect-lens cannot act on this model"):
            llm.generate(PROMPTS[1], sp, use_tqdm=False)
    assert llm.generate(PROMPTS[0], plain, use_tqdm=False)[0].outputs[0].token_ids == ref


def test_a_fetch_that_raises_leaves_nothing_with_the_workers(llama, monkeypatch):
    """The frontend's round trip for results fails (a worker unreachable, say): the caller gets that error, and
    the workers drop what they stored for the call's requests — no caller will ask for it again."""
    from vllm_worker.frontend import fetch as frontend_fetch

    def unreachable(engine, todo):  # the round trips' generator, failing at its first RPC
        raise ConnectionError("worker went away")
        yield

    monkeypatch.setattr(frontend_fetch, "_fetch_rounds", unreachable)
    with pytest.raises(ConnectionError):
        llama.generate(PROMPTS[:3], _batch(False), use_tqdm=False)
    monkeypatch.undo()
    assert llama.collective_rpc("lens_status")[0]["stored_requests"] == 0
    # and the next call gets its results
    ok = llama.generate([PROMPTS[0]], _batch()[0], use_tqdm=False)[0]
    assert ok.activations["residual_stream"].shape[0] == 2
