"""Chunked prefill and prefix caching give the same captures as neither; steering never leaks
through the prefix cache into another request."""

from __future__ import annotations

import torch
from vllm import SamplingParams

from support.reference import greedy, hf_model, residuals, steer_edit
from vllm_worker import SteeringVector

LONG = " ".join(["the water of people will come down to the side and they said"] * 4)


def _capture(llm, prompt, layers=(0, 1, 2, 3), max_tokens=4, extra=None):
    args = {"output_residual_stream": list(layers)}
    args.update(extra or {})
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=args)
    return llm.generate([prompt], sp, use_tqdm=False)[0]


def test_chunked_prefill_and_prefix_cache_same_captures(engine_factory):
    plain = engine_factory("llama", enable_prefix_caching=False)
    chunked = engine_factory(
        "llama", enable_prefix_caching=True, max_num_batched_tokens=16, block_size=32, enable_chunked_prefill=True
    )
    cached = engine_factory("llama", enable_prefix_caching=True, block_size=32)
    assert chunked.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens == 16
    ref = _capture(plain, LONG)
    n_prompt = len(ref.prompt_token_ids)
    assert n_prompt > 40  # spans several 16-token chunks
    # warm the prefix cache with plain requests on the same prompt, then capture
    for llm in (chunked, cached):
        llm.generate([LONG], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
        again = llm.generate([LONG], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
        assert again.num_cached_tokens > 0, "prefix cache not in use: the test would prove nothing"
        got = _capture(llm, LONG)
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        a, b = got.activations["residual_stream"], ref.activations["residual_stream"]
        assert a.shape == b.shape == (4, n_prompt + 3, 128)
        assert (a - b).abs().max() <= 1e-5
    ids = list(ref.prompt_token_ids) + list(ref.outputs[0].token_ids)
    hf, _ = residuals(hf_model("llama"), ids[:-1])
    assert (ref.activations["residual_stream"] - hf).abs().max() <= 1e-4


def test_3d_steering_under_chunked_prefill_lands_once(engine_factory):
    chunked = engine_factory(
        "llama", enable_prefix_caching=True, max_num_batched_tokens=16, block_size=32, enable_chunked_prefill=True
    )
    k = 30  # inside the second chunk
    v = torch.randn(1, 1, 128, generator=torch.Generator().manual_seed(3)) * 2
    sv = SteeringVector(v, [1], position_indices=[k])
    out = _capture(chunked, LONG, max_tokens=5, extra={"apply_steering_vectors": [sv]})
    edit = steer_edit({1: v[0]}, positions=[k])
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    ref, _ = residuals(hf_model("llama"), ids[:-1], edit)
    assert (out.activations["residual_stream"] - ref).abs().max() <= 1e-4
    assert list(out.outputs[0].token_ids) == greedy(hf_model("llama"), list(out.prompt_token_ids), 5, edit)
    unsteered, _ = residuals(hf_model("llama"), ids[:-1])
    moved = (out.activations["residual_stream"][1] - unsteered[1]).abs().amax(-1) > 1e-3
    assert moved.nonzero().flatten().tolist() == [k]


def _same_logprobs(a, b) -> None:
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        for tok, lp in x.items():
            assert abs(lp.logprob - y[tok].logprob) <= 1e-5


def test_steering_never_reaches_other_requests_through_the_prefix_cache(engine_factory):
    cached = engine_factory("llama", enable_prefix_caching=True, block_size=32)
    uncached = engine_factory("llama", enable_prefix_caching=False)
    v = torch.randn(1, 128, generator=torch.Generator().manual_seed(9)) * 5
    sp_plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    sp_steer = SamplingParams(
        max_tokens=6,
        temperature=0,
        ignore_eos=True,
        logprobs=3,
        extra_args={"apply_steering_vectors": [SteeringVector(v, [0])]},
    )
    # 1) steered first on a fresh prompt, then plain: the plain one must not read steered KV
    p1 = LONG + " people"
    s1 = cached.generate([p1], sp_steer, use_tqdm=False)[0]
    after = cached.generate([p1], sp_plain, use_tqdm=False)[0]
    _same_logprobs(after, uncached.generate([p1], sp_plain, use_tqdm=False)[0])
    # 2) identical steering may reuse its own KV, exactly
    s2 = cached.generate([p1], sp_steer, use_tqdm=False)[0]
    assert s2.num_cached_tokens > 0
    _same_logprobs(s1, s2)
    _same_logprobs(s1, uncached.generate([p1], sp_steer, use_tqdm=False)[0])
    # 3) plain first, then steered: the steered one must not read unsteered KV
    p2 = LONG + " water"
    cached.generate([p2], sp_plain, use_tqdm=False)
    _same_logprobs(
        cached.generate([p2], sp_steer, use_tqdm=False)[0], uncached.generate([p2], sp_steer, use_tqdm=False)[0]
    )
    assert s1.outputs[0].token_ids != after.outputs[0].token_ids, "steering had no visible effect"
