"""Per-request hooks and persistent hooks, against HF transformers doing the same edit."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.reference import greedy, hf_model, residuals, zero_dim_edit
from vllm_worker import Hook, HookError

PROMPT = "the water of people will come down to the side"
OTHER = "a long thing to see him"


def _sp(max_tokens=6, **extra):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=extra or None)


def _zero_dim(dim):
    def fn(ctx, h):
        h = h.clone()
        h[:, dim] = 0
        ctx.saved.setdefault("layers", []).append(ctx.layer_idx)
        return h

    return fn


def test_zero_ablation_at_two_layers_equals_hf(llama):
    dim = 7
    out = llama.generate(
        [PROMPT], _sp(apply_hooks=[Hook(_zero_dim(dim), [1, 2])], output_residual_stream=[0, 1, 2, 3]), use_tqdm=False
    )[0]

    edit = zero_dim_edit(dim, (1, 2))
    hf = hf_model("llama")
    assert list(out.outputs[0].token_ids) == greedy(hf, list(out.prompt_token_ids), 6, edit)
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    ref, _ = residuals(hf, ids[:-1], edit)
    acts = out.activations["residual_stream"]
    assert (acts - ref).abs().max() <= 1e-4
    assert acts[1, :, dim].abs().max() == 0 and acts[3, :, dim].abs().max() > 0
    # one call per hooked layer per forward step: prefill + 5 decode steps, two layers each
    assert out.hook_results["0"]["layers"] == [1, 2] * 6


def test_layer0_prehook_seeded_noise_equals_hf(llama):
    """The corruption step of causal tracing: noise on the embeddings, keyed by absolute position."""
    noise = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.5

    def corrupt(ctx, h):
        return h + noise.to(h.device)[ctx.positions]

    out = llama.generate(
        [PROMPT], _sp(apply_hooks=[Hook(corrupt, [0], pre=True)], output_residual_stream=[0, 3]), use_tqdm=False
    )[0]
    hf = hf_model("llama")
    embed_edit = lambda e: e + noise[: e.shape[1]].unsqueeze(0)  # noqa: E731
    assert list(out.outputs[0].token_ids) == greedy(hf, list(out.prompt_token_ids), 6, embed_edit=embed_edit)
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    ref, _ = residuals(hf, ids[:-1], embed_edit=embed_edit)
    assert (out.activations["residual_stream"] - ref[[0, 3]]).abs().max() <= 1e-4


def _logit_lens(ctx, h):
    w = ctx.get_parameter("lm_head.weight")
    g = ctx.get_parameter("model.norm.weight")
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * g.float()
    top = (x @ w.float().T).topk(5, dim=-1).indices
    ctx.saved.setdefault(ctx.layer_idx, []).append((ctx.positions.cpu(), top.cpu()))


def test_logit_lens_with_get_parameter_matches_hf(engine_factory):
    llm = engine_factory("smollm2")
    L = llm.llm_engine.model_config.get_total_num_hidden_layers()
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Name a color."}], tokenize=False, add_generation_prompt=True
    )
    out = llm.generate([prompt], _sp(4, apply_hooks=[Hook(_logit_lens, list(range(L)))]), use_tqdm=False)[0]
    hf = hf_model("smollm2")
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    ref, _ = residuals(hf, ids[:-1])
    saved = out.hook_results["0"]
    assert sorted(saved) == list(range(L))
    agree = total = 0
    for layer in range(L):
        pos = torch.cat([p for p, _ in saved[layer]])
        top = torch.cat([t for _, t in saved[layer]])
        assert pos.tolist() == list(range(len(ids) - 1))
        hf_top = (hf.model.norm(ref[layer]) @ hf.lm_head.weight.T).topk(5, dim=-1).indices
        agree += (top == hf_top).all(-1).sum().item()
        total += len(pos)
    assert agree == total, f"{agree}/{total} positions with equal top-5"
    assert (top[-1:, 0] == hf_top[-1:, 0]).all()


def test_pre_and_post_hooks_keep_separate_state_and_requests_stay_apart(llama):
    def count(tag):
        def fn(ctx, h):
            ctx.saved["calls"] = ctx.saved.get("calls", 0) + 1
            ctx.saved["tag"] = tag
            ctx.saved.setdefault("rows", []).append(ctx.seq_len)
            ctx.saved["request_id"] = ctx.request_id
            return None

        return fn

    hooks = [Hook(count("pre"), [2], pre=True), Hook(count("post"), [2])]
    outs = llama.generate([PROMPT, OTHER], [_sp(3, apply_hooks=hooks), _sp(5, apply_hooks=hooks)], use_tqdm=False)
    a, b = outs
    n_a, n_b = len(a.prompt_token_ids), len(b.prompt_token_ids)
    assert a.hook_results["0"]["tag"] == "pre" and a.hook_results["1"]["tag"] == "post"
    assert a.hook_results["0"]["rows"] == [n_a, 1, 1] and b.hook_results["1"]["rows"] == [n_b, 1, 1, 1, 1]
    assert a.hook_results["0"]["request_id"] == a.request_id and b.hook_results["0"]["request_id"] == b.request_id
    assert hooks[0].fn is not None and len(hooks) == 2  # the caller's list is untouched


def test_failing_hook_fails_only_its_request(llama):
    baseline = [list(o.outputs[0].token_ids) for o in llama.generate([PROMPT, OTHER], _sp(), use_tqdm=False)]

    def boom(ctx, h):
        raise ZeroDivisionError("deliberate failure in user hook")

    def wrong_shape(ctx, h):
        return h[:, :5]

    for bad, text in (
        (boom, "ZeroDivisionError: deliberate failure in user hook"),
        (wrong_shape, "hook returned shape"),
    ):
        with pytest.raises(HookError) as exc:
            llama.generate(
                [PROMPT, OTHER], [_sp(apply_hooks=[Hook(bad, [1])]), _sp(output_residual_stream=[0])], use_tqdm=False
            )
        assert text in str(exc.value) and "Traceback" in str(exc.value)
        failed, ok = exc.value.outputs
        assert failed.hook_error is not None
        assert list(ok.outputs[0].token_ids) == baseline[1] and ok.activations["residual_stream"].shape[0] == 1
    # the engine keeps serving
    assert [list(o.outputs[0].token_ids) for o in llama.generate([PROMPT, OTHER], _sp(), use_tqdm=False)] == baseline


def test_persistent_hooks_over_20_requests(engine_factory):
    llm = engine_factory("llama", enable_prefix_caching=False)
    llm.clear_hooks()

    def norm_at_last(ctx, h):
        ctx.saved.setdefault("norms", []).append(h[-1].norm().item())

    assert llm.register_hooks([Hook(norm_at_last, [3])]) == 1
    prompts = [f"{PROMPT} {w}" for w in "the a of to and in is it that was".split()]
    llm.generate(prompts, _sp(3), use_tqdm=False)  # 10 concurrent
    for p in prompts[:10]:
        llm.generate([p + " people"], _sp(2), use_tqdm=False)  # 10 one by one
    results = llm.collect_hook_results()
    assert len(results) == 20
    assert all(len(r["0"]["norms"]) in (2, 3) for r in results.values())
    assert len(llm.collect_hook_results()) == 20  # non-destructive
    llm.clear_hook_results()
    assert llm.collect_hook_results() == {}
    llm.generate([PROMPT], _sp(2), use_tqdm=False)
    assert len(llm.collect_hook_results()) == 1  # hooks kept
    llm.clear_hooks()
    llm.generate([PROMPT], _sp(2), use_tqdm=False)
    assert llm.collect_hook_results() == {}


def test_persistent_results_cap_is_an_error_not_a_silent_drop(llama, monkeypatch):
    monkeypatch.setenv("VLLM_LENS_MAX_PERSISTENT_RESULTS", "2")  # read when asked
    llama.clear_hooks()
    llama.register_hooks([Hook(lambda ctx, h: None, range(2))])
    try:
        llama.generate([PROMPT, OTHER], _sp(2), use_tqdm=False)
        with pytest.raises(HookError, match="persistent hook results are full"):
            llama.generate([PROMPT], _sp(2), use_tqdm=False)
        assert len(llama.collect_hook_results()) == 2
        llama.clear_hook_results()
        llama.generate([PROMPT], _sp(2), use_tqdm=False)
        assert len(llama.collect_hook_results()) == 1
    finally:
        llama.clear_hooks()


def test_misbehaving_hooks_stay_inside_their_request(llama):
    """Hooks that return NaN, a wrong dtype, a non-tensor, or that sleep: the request that carries the
    hook gets a HookError naming the problem (or, for the slow one, its results); its batch-mate keeps
    its solo tokens and numbers. NaN values are never written into the stream: on vLLM's CPU attention
    they reached the batch-mate (its tokens all became 0) before this was guarded."""
    import time

    solo = llama.generate([OTHER], _sp(output_residual_stream=[2]), use_tqdm=False)[0]

    def nan(ctx, h):
        return h * float("nan")

    def wrong_dtype(ctx, h):
        return h.double()

    def not_a_tensor(ctx, h):
        return [1, 2, 3]

    def slow(ctx, h):
        time.sleep(0.05)

    for bad, error in (
        (nan, "returned NaN or inf values"),
        (wrong_dtype, "hook returned shape"),
        (not_a_tensor, "expected a Tensor or None"),
        (slow, None),
    ):
        sps = [_sp(apply_hooks=[Hook(bad, [1])], output_residual_stream=[2]), _sp(output_residual_stream=[2])]
        if error is None:
            mine, mate = llama.generate([PROMPT, OTHER], sps, use_tqdm=False)
        else:
            with pytest.raises(HookError, match=error) as exc:
                llama.generate([PROMPT, OTHER], sps, use_tqdm=False)
            mine, mate = exc.value.outputs
            assert mine.hook_error is not None
        assert mate.hook_error is None and list(mate.outputs[0].token_ids) == list(solo.outputs[0].token_ids)
        assert torch.equal(mate.activations["residual_stream"], solo.activations["residual_stream"])
    ids = list(solo.prompt_token_ids) + list(solo.outputs[0].token_ids)
    ref, _ = residuals(hf_model("llama"), ids[:-1])
    assert (solo.activations["residual_stream"][0] - ref[2]).abs().max() <= 1e-4


def _zero_dim_batched(dim):
    def fn(ctx, h):
        assert ctx.rows and ctx.rows[-1][2] == h.shape[0] == ctx.positions.shape[0]
        h = h.clone()
        h[:, dim] = 0
        for rid, s, e in ctx.rows:
            ctx.saved[rid].setdefault("calls", []).append((ctx.layer_idx, len(ctx.rows), e - s))
        return h

    return fn


def test_batched_hook_runs_once_for_all_its_requests_and_equals_hf(llama):
    """`Hook(batched=True)`: one call per step and layer on the stacked rows of every request carrying it,
    `ctx.rows` says whose rows are where; each request's numbers equal HF with the edit, and a batch-mate
    without the hook equals HF without it."""
    dim = 7
    hook = Hook(_zero_dim_batched(dim), [1, 2], batched=True)
    prompts = [PROMPT, OTHER, PROMPT + " of the first", OTHER + " again"]
    sps = [_sp(apply_hooks=[hook], output_residual_stream=[3]) for _ in prompts[:3]] + [_sp(output_residual_stream=[3])]
    outs = llama.generate(prompts, sps, use_tqdm=False)
    hf = hf_model("llama")
    edit = zero_dim_edit(dim, (1, 2))
    for i, out in enumerate(outs):
        e = edit if i < 3 else None
        assert list(out.outputs[0].token_ids) == greedy(hf, list(out.prompt_token_ids), 6, e)
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        ref, _ = residuals(hf, ids[:-1], e)
        assert (out.activations["residual_stream"] - ref[[3]]).abs().max() <= 1e-4
    for out in outs[:3]:
        calls = out.hook_results["0"]["calls"]
        assert [c[0] for c in calls] == [1, 2] * 6  # prefill + 5 decode steps, two layers each
        assert calls[0][1] == 3 and calls[0][2] == len(out.prompt_token_ids)  # the prefill call held all three
    assert outs[3].hook_results in (None, {})


def test_batched_hook_that_raises_fails_its_requests_only(llama):
    baseline = list(llama.generate([OTHER], _sp(), use_tqdm=False)[0].outputs[0].token_ids)

    def boom(ctx, h):
        raise ZeroDivisionError("deliberate failure in a batched hook")

    hook = Hook(boom, [1], batched=True)
    with pytest.raises(HookError) as exc:
        llama.generate(
            [PROMPT, PROMPT + " again", OTHER],
            [_sp(apply_hooks=[hook])] * 2 + [_sp(output_residual_stream=[0])],
            use_tqdm=False,
        )
    a, b, ok = exc.value.outputs
    assert a.hook_error is not None and b.hook_error is not None and len(exc.value.failures) == 2
    assert "deliberate failure in a batched hook" in str(exc.value)
    assert ok.hook_error is None and list(ok.outputs[0].token_ids) == baseline


def _boom_batched(ctx, h):
    raise ZeroDivisionError("deliberate failure in a batched hook")


def test_two_failing_hooks_of_one_request_report_the_first(llama):
    """One rule for every failure (hooks, our own code): the first one is the one reported. The same batched
    hook listed twice shares one call, which fails for both: hook 0's failure is the request's."""
    hook = Hook(_boom_batched, [1], batched=True)
    with pytest.raises(HookError) as exc:
        llama.generate([PROMPT], [_sp(3, apply_hooks=[hook, hook])], use_tqdm=False)
    err = exc.value.outputs[0].hook_error
    assert "hook 0 (post-hook at layer 1)" in err and "hook 1 (" not in err, err


def _mean_the_per_request_way(ctx, h):
    ctx.saved["mean"] = h.mean()


def test_a_batched_hook_writing_ctx_saved_directly_is_an_error_naming_the_right_way(llama):
    """`ctx.saved` of a batched hook holds one dict per request: a write of another key (the per-request
    habit, `ctx.saved["mean"] = ...`) would be lost without a word, so it fails the call's requests with an
    error that names `ctx.saved[request_id]` and `ctx.save_rows`; a batch-mate without the hook is untouched."""
    baseline = list(llama.generate([OTHER], _sp(), use_tqdm=False)[0].outputs[0].token_ids)
    hook = Hook(_mean_the_per_request_way, [1], batched=True)
    with pytest.raises(HookError) as exc:
        llama.generate([PROMPT, PROMPT + " again", OTHER], [_sp(apply_hooks=[hook])] * 2 + [_sp()], use_tqdm=False)
    a, b, ok = exc.value.outputs
    for out in (a, b):
        assert "ctx.saved[request_id]" in out.hook_error and "ctx.save_rows" in out.hook_error, out.hook_error
        assert "'mean'" in out.hook_error
    assert ok.hook_error is None and list(ok.outputs[0].token_ids) == baseline


def test_persistent_batched_hook_reads_every_request_in_one_call(llama):
    def last_norm(ctx, h):
        norms = h.norm(dim=-1)
        for rid, s, e in ctx.rows:
            ctx.saved[rid].setdefault("norm", []).append(norms[e - 1])
            ctx.saved[rid]["widest"] = max(ctx.saved[rid].get("widest", 0), len(ctx.rows))

    llama.clear_hooks()
    llama.register_hooks([Hook(last_norm, [2], batched=True)])
    try:
        outs = llama.generate([PROMPT, OTHER], [_sp(3, output_residual_stream=[2])] * 2, use_tqdm=False)
        results = llama.collect_hook_results()
    finally:
        llama.clear_hooks()
    for out in outs:
        got = results[out.request_id]["0"]
        assert got["widest"] == 2 and len(got["norm"]) == 3  # prefill + 2 decode steps
        acts = out.activations["residual_stream"][0]
        n = len(out.prompt_token_ids)
        want = acts[[n - 1, n, n + 1]].norm(dim=-1)
        assert torch.allclose(torch.stack([x.cpu() for x in got["norm"]]), want, atol=1e-4)
