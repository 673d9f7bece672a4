"""Batched hooks' helpers (`ctx.segment_ids`, `ctx.counts`, `ctx.save_rows`) and the per-request dispatch
(one stream sum per tap, each request's first hook on a view of its rows), against HF transformers."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.reference import hf_model, residuals
from vllm_worker import Hook, HookError

SHORT = "the water of people"
OTHER = "a long thing to see him"
LONG = " ".join(["the water of people will come down to the side and they said"] * 4)


def _sp(max_tokens=4, **extra):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=extra or None)


def _segments(ctx, h):
    """Checks the helpers against `ctx.rows` (host-side, test only) and saves the step's mean norm per
    request in one call."""
    seg, counts = ctx.segment_ids, ctx.counts
    assert seg.dtype == counts.dtype == torch.int64 and seg.device == counts.device == h.device
    want = [e - s for _, s, e in ctx.rows]
    ok = counts.tolist() == want and seg.tolist() == [i for i, n in enumerate(want) for _ in range(n)]
    for rid, _, _ in ctx.rows:
        ctx.saved[rid].setdefault("checks", []).append((ok, tuple(sorted(set(want)))))
    sums = torch.zeros(len(ctx.rows), device=h.device).index_add_(0, seg, h.float().norm(dim=-1))
    means = sums / counts
    ctx.save_rows("norm", means)
    ctx.save_rows("pair", torch.stack([means, torch.full_like(means, ctx.layer_idx)], 1))


def _norm_per_request(ctx, h):
    ctx.saved["norm"] = h.float().norm(dim=-1).mean()


def test_segment_ids_counts_and_save_rows_in_a_mixed_batch(engine_factory):
    """Chunked prefill (16 tokens a step): the long prompt's chunks share steps with the short requests'
    decode rows; a request without hooks sits between. Every call's helpers match `ctx.rows`; `save_rows`
    delivers what per-request `ctx.saved` writes give (the last write: layer 2 of the last step), = HF."""
    llm = engine_factory(
        "llama", enable_prefix_caching=True, max_num_batched_tokens=16, block_size=32, enable_chunked_prefill=True
    )
    batched = Hook(_segments, [1, 2], batched=True)
    per_request = Hook(_norm_per_request, [1, 2])
    prompts = [SHORT, LONG, OTHER, SHORT + " again"]
    hooked = _sp(apply_hooks=[batched, per_request])
    outs = llm.generate(prompts, [hooked, hooked, _sp(), hooked], use_tqdm=False)
    hf = hf_model("llama")
    mixed = False
    for i, out in enumerate(outs):
        if i == 2:
            assert out.hook_results in (None, {})
            continue
        got, ref_own = out.hook_results["0"], out.hook_results["1"]
        assert all(ok for ok, _ in got["checks"]), got["checks"]
        mixed |= any(1 in sizes and max(sizes) > 1 for _, sizes in got["checks"])
        assert isinstance(got["norm"], torch.Tensor) and got["norm"].shape == ()
        assert torch.allclose(got["norm"], ref_own["norm"].cpu(), rtol=1e-5)
        assert got["pair"].shape == (2,) and got["pair"][1] == 2 and got["pair"][0] == got["norm"]
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        ref, _ = residuals(hf, ids[:-1])
        assert torch.allclose(got["norm"], ref[2, -1].norm(), rtol=1e-4)  # the last step: one decode row
    assert mixed  # some step held prefill rows next to decode rows


def test_failing_hook_fails_only_its_request_and_hooks_see_their_own_rows(llama):
    """Per-request hooks on one tap: a hook that raises fails its request only; a hook editing `h` in place
    changes nothing (not the stream, not the next hook of its request, not a batch-mate); a hook after one
    that replaced the stream reads the replacement. Batch-mates' numbers equal HF and a run alone."""
    dim = 5

    def boom(ctx, h):
        raise ZeroDivisionError("deliberate failure in one request's hook")

    def vandal(ctx, h):
        h.zero_()

    def zero_dim(ctx, h):
        h = h.clone()
        h[:, dim] = 0
        return h

    def read(ctx, h):
        ctx.saved.setdefault("norm", []).append(h.norm(dim=-1).cpu())
        ctx.saved.setdefault("dim", []).append(float(h[:, dim].abs().max()))

    solo = llama.generate([OTHER], _sp(output_residual_stream=[1, 3]), use_tqdm=False)[0]
    sps = [
        _sp(apply_hooks=[Hook(vandal, [1]), Hook(read, [1])], output_residual_stream=[1, 3]),
        _sp(apply_hooks=[Hook(boom, [1])]),
        _sp(apply_hooks=[Hook(zero_dim, [1]), Hook(read, [1])]),
        _sp(apply_hooks=[Hook(read, [1])], output_residual_stream=[1, 3]),
        _sp(output_residual_stream=[1, 3]),
    ]
    with pytest.raises(HookError) as exc:
        llama.generate([SHORT, LONG, SHORT + " again", OTHER, OTHER], sps, use_tqdm=False)
    vandalised, failed, zeroed, reader, plain = exc.value.outputs
    assert list(exc.value.failures) == [failed.request_id] and "deliberate failure" in str(exc.value)
    for out in (vandalised, zeroed, reader, plain):
        assert out.hook_error is None
    for out in (reader, plain):  # batch-mates of the failure: as if alone
        assert list(out.outputs[0].token_ids) == list(solo.outputs[0].token_ids)
        assert torch.equal(out.activations["residual_stream"], solo.activations["residual_stream"])
    hf = hf_model("llama")
    for out in (vandalised, reader):  # in-place edits reached nothing; the reader saw the true stream
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        ref, _ = residuals(hf, ids[:-1])
        assert (out.activations["residual_stream"] - ref[[1, 3]]).abs().max() <= 1e-4
        assert torch.allclose(
            torch.cat(out.hook_results["1" if out is vandalised else "0"]["norm"]), ref[1].norm(dim=-1), atol=1e-4
        )
    assert zeroed.hook_results["1"]["dim"] == [0.0] * 4  # read after the replacement: prefill + 3 decode steps


def test_helpers_are_for_batched_hooks(llama):
    def fn(ctx, h):
        ctx.counts

    with pytest.raises(HookError) as exc:
        llama.generate([SHORT], _sp(2, apply_hooks=[Hook(fn, [0])]), use_tqdm=False)
    assert "is for batched hooks" in str(exc.value)

    def wrong(ctx, h):
        ctx.save_rows("x", torch.zeros(len(ctx.rows) + 1))

    with pytest.raises(HookError) as exc:
        llama.generate([SHORT, OTHER], _sp(2, apply_hooks=[Hook(wrong, [0], batched=True)]), use_tqdm=False)
    assert "one row per request (2)" in str(exc.value) and len(exc.value.failures) == 2


def test_save_rows_of_a_persistent_batched_hook_reach_collect_hook_results(llama):
    """A persistent batched hook's `save_rows` values come back from `collect_hook_results` as each
    request's own tensor (the last write: the last step), equal to its capture."""

    def last_norm(ctx, h):
        last = torch.cumsum(ctx.counts, 0) - 1  # each request's last row in this call
        ctx.save_rows("last", h.norm(dim=-1)[last])

    llama.clear_hooks()
    llama.register_hooks([Hook(last_norm, [2], batched=True)])
    try:
        outs = llama.generate([SHORT, OTHER], [_sp(3, output_residual_stream=[2])] * 2, use_tqdm=False)
        results = llama.collect_hook_results()
    finally:
        llama.clear_hooks()
    for out in outs:
        got = results[out.request_id]["0"]["last"]
        acts = out.activations["residual_stream"][0]
        n = len(out.prompt_token_ids)
        assert isinstance(got, torch.Tensor) and got.shape == () and got.device.type == "cpu"
        assert torch.allclose(got, acts[n + 1].norm(), atol=1e-4)  # prefill, then 2 decode steps
