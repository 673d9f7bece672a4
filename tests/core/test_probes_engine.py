"""Probes on the engine (issue #42 §1-2) over the tiny llama: per-token scores equal HF's float32 residual
at the probe's layers `@ weight.T + bias` (mean / std first; sigmoid when asked; multi-layer probes over the
concatenated layers) at prompt and generated positions, on the graph-safe path (one projection per site for
the whole batch) and on the Python path (a request that also hooks); batch-mates are unchanged; the
aggregates equal the pure functions over the generated positions; bad input is a ValueError naming the field
and the engine keeps serving."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.hook_fns import ablate
from support.reference import greedy, hf_model, point_activations, residuals, zero_dim_edit
from vllm_worker import Hook, HookError, counters
from vllm_worker.probes import aggregate, save_probe
from vllm_worker.worker import faults
from vllm_worker.worker.probes import PROBE_COUNTS

D = 128
PROMPTS = ["the water of people will come down to the side", "a long thing to see him", "how many water did she"]


def _parts(seed: int, n_out: int, layers: list[int], normed: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    k = len(layers) * D
    out = dict(weight=torch.randn(n_out, k, generator=g) / k**0.5, bias=torch.randn(n_out, generator=g), layers=layers)
    if normed:
        out.update(mean=torch.randn(k, generator=g) * 0.1, std=torch.rand(k, generator=g) + 0.5)
    return out


PROBES = {
    "pr_l2": dict(_parts(1, 2, [2], True), output="logit"),
    "pr_l13": dict(_parts(2, 1, [1, 3], True), output="sigmoid", aggregate=["rolling_max:3", "ema:0.8"]),
    "pr_l0": dict(_parts(3, 3, [0], False), output="logit"),
}


@pytest.fixture(scope="module")
def llm(llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("probes")
    for name, parts in PROBES.items():
        if name == "pr_l0":  # from tensors
            info = llama.load_probe(name, **parts)
        else:  # from a folder in the served format
            info = llama.load_probe(name, str(save_probe(root / name, **parts)))
        assert info["layers"] == parts["layers"] and info["n_out"] == parts["weight"].shape[0]
    assert {p["name"] for p in llama.list_probes()} >= set(PROBES)
    return llama


def _sp(n=6, **extra):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, extra_args=extra or None)


def _ref(name: str, out, edit=None) -> torch.Tensor:
    """HF float32 residuals at the probe's layers, concatenated, through the probe's formula by hand."""
    p = PROBES[name]
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    streams, _ = residuals(hf_model("llama"), ids[:-1], edit)
    x = torch.cat([streams[l] for l in p["layers"]], dim=-1)
    if "mean" in p:
        x = (x - p["mean"]) / p["std"]
    y = x @ p["weight"].T + p["bias"]
    return torch.sigmoid(y) if p["output"] == "sigmoid" else y


def _check(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert (got - ref).abs().max() <= 1e-4, (got - ref).abs().max()


def test_scores_equal_hf_on_the_graph_path_with_a_plain_batch_mate(llm):
    before = dict(PROBE_COUNTS), counters.STEP_TIMINGS["graph_steps"]
    sps = [
        _sp(output_probe_scores=["pr_l2"]),
        _sp(output_probe_scores={"pr_l2": {}, "pr_l13": {"aggregate": ["max", "rolling_max:2"]}, "pr_l0": {}}),
        _sp(),
    ]
    outs = llm.generate(PROMPTS, sps, use_tqdm=False)
    a, b, c = outs
    _check(a.activations["probe_scores"]["pr_l2"], _ref("pr_l2", a))
    assert set(a.activations["probe_scores"]) == {"pr_l2"}
    for name in ("pr_l2", "pr_l13", "pr_l0"):
        _check(b.activations["probe_scores"][name], _ref(name, b))
    # the request's aggregates: the defaults, the file's and its own, over the generated positions
    n_prompt = len(b.prompt_token_ids)
    aggs = b.activations["probe_aggregates"]["pr_l13"]
    assert list(aggs) == ["mean", "max", "last", "rolling_max:3", "ema:0.8", "rolling_max:2"]
    gen = _ref("pr_l13", b)[n_prompt - 1 :]
    assert len(gen) == 6
    for k, v in aggs.items():
        assert v.shape == (1,) and (v - aggregate(gen, k)).abs().max() <= 1e-5, k
    assert list(a.activations["probe_aggregates"]["pr_l2"]) == ["mean", "max", "last"]
    # the batch-mate without probes: nothing, and HF's greedy tokens
    assert c.activations is None
    assert list(c.outputs[0].token_ids) == greedy(hf_model("llama"), list(c.prompt_token_ids), 6)
    # graph-safe steps, one projection per site and step for every request and probe (4 sites: layers 0-3)
    steps = counters.STEP_TIMINGS["graph_steps"] - before[1]
    assert steps > 0
    assert 0 < PROBE_COUNTS["projections"] - before[0]["projections"] <= 4 * steps
    rows = sum(len(o.prompt_token_ids) + 5 for o in (a, b))  # pr_l2's rows (a and b) ...
    rows += 3 * (len(b.prompt_token_ids) + 5)  # ... and b's at layers 1, 3 and 0
    assert PROBE_COUNTS["rows"] - before[0]["rows"] == rows


def test_scores_with_captures_and_chosen_positions(llm):
    """A request capturing the probe's layer lends its staged rows; aggregates over chosen positions."""
    sp = _sp(
        output_residual_stream=[2],
        output_probe_scores={"pr_l2": {"positions": [0, 2, 100], "aggregate": ["ema:0.5"]}},
    )
    out = llm.generate([PROMPTS[0]], sp, use_tqdm=False)[0]
    ref = _ref("pr_l2", out)
    _check(out.activations["probe_scores"]["pr_l2"], ref)
    p = PROBES["pr_l2"]
    cap = out.activations["residual_stream"][0]
    _check(((cap - p["mean"]) / p["std"]) @ p["weight"].T + p["bias"], ref)
    got = out.activations["probe_aggregates"]["pr_l2"]
    assert (got["ema:0.5"] - aggregate(ref[[0, 2]], "ema:0.5")).abs().max() <= 1e-5
    sp = _sp(output_probe_scores={"pr_l2": {"positions": "all"}})
    out = llm.generate([PROMPTS[1]], sp, use_tqdm=False)[0]
    assert (out.activations["probe_aggregates"]["pr_l2"]["mean"] - _ref("pr_l2", out).mean(0)).abs().max() <= 1e-5
    # "prompt": the prompt's positions (the last one included); positions the request never reached: NaN
    sps = [
        _sp(output_probe_scores={"pr_l2": {"positions": "prompt", "aggregate": ["rolling_max:2"]}}),
        _sp(output_probe_scores={"pr_l2": {"positions": [100], "aggregate": ["ema:0.5"]}}),
    ]
    a, b = llm.generate(PROMPTS[1:], sps, use_tqdm=False)
    ref = _ref("pr_l2", a)[: len(a.prompt_token_ids)]
    for k, v in a.activations["probe_aggregates"]["pr_l2"].items():
        assert (v - aggregate(ref, k)).abs().max() <= 1e-5, k
    got = b.activations["probe_aggregates"]["pr_l2"]
    assert list(got) == ["mean", "max", "last", "ema:0.5"] and all(bool(v.isnan().all()) for v in got.values())
    _check(b.activations["probe_scores"]["pr_l2"], _ref("pr_l2", b))


def test_python_path_a_request_that_also_hooks(llm):
    """The hook edits layer 2 before the probe reads it there (steer, hooks, then reads): the Python path."""
    sps = [
        _sp(apply_hooks=[Hook(ablate(5), [2])], output_probe_scores=["pr_l2", "pr_l13"]),
        _sp(output_probe_scores=["pr_l2"]),
    ]
    hooked, plain = llm.generate(PROMPTS[:2], sps, use_tqdm=False)
    edit = zero_dim_edit(5, {2})
    assert list(hooked.outputs[0].token_ids) == greedy(hf_model("llama"), list(hooked.prompt_token_ids), 6, edit)
    _check(hooked.activations["probe_scores"]["pr_l2"], _ref("pr_l2", hooked, edit))
    _check(hooked.activations["probe_scores"]["pr_l13"], _ref("pr_l13", hooked, edit))
    _check(plain.activations["probe_scores"]["pr_l2"], _ref("pr_l2", plain))


def test_n_samples_and_replacing_a_probe(llm):
    sp = SamplingParams(max_tokens=4, temperature=1.0, seed=3, n=2, extra_args={"output_probe_scores": ["pr_l0"]})
    out = llm.generate([PROMPTS[2]], sp, use_tqdm=False)[0]
    for s in out.outputs:
        ids = list(out.prompt_token_ids) + list(s.token_ids)
        x, _ = residuals(hf_model("llama"), ids[:-1])
        ref = x[0] @ PROBES["pr_l0"]["weight"].T + PROBES["pr_l0"]["bias"]
        _check(s.activations["probe_scores"]["pr_l0"], ref)
    w = torch.ones(1, D)
    info = llm.load_probe("tmp_probe", weight=w, layers=[1])
    assert info["hash"] and info["output"] == "logit"
    info2 = llm.load_probe("tmp_probe", weight=2 * w, layers=[1])
    assert info2["hash"] != info["hash"]
    out = llm.generate([PROMPTS[0]], _sp(3, output_probe_scores=["tmp_probe"]), use_tqdm=False)[0]
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    x, _ = residuals(hf_model("llama"), ids[:-1])
    _check(out.activations["probe_scores"]["tmp_probe"], (2 * x[1].sum(-1, keepdim=True)))
    assert llm.delete_probe("tmp_probe") is True and llm.delete_probe("tmp_probe") is False
    assert "tmp_probe" not in {p["name"] for p in llm.list_probes()}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(weight=torch.ones(1, D + 1), layers=[1]), "weight"),
        (dict(weight=torch.ones(1, D), layers=[9]), "layers[0]"),
        (dict(weight=torch.ones(1, D), layers=[1], point="resid_pots"), "point"),
        (dict(weight=torch.full((1, D), float("nan")), layers=[1]), "weight"),
        (dict(weight=torch.ones(1, D), bias=torch.tensor([float("inf")]), layers=[1]), "bias"),
        (dict(weight=torch.ones(1, D), layers=[1], output="softmax"), "output"),
        (dict(layers=[1]), "weight"),
        (dict(weight=torch.ones(1, D), layers=[1], layer=2), "layer"),
        (dict(weight=torch.ones(1, D), layers=[1], point="mlp_post"), "point"),  # d_mlp wide (it failed mid-request)
        (dict(weight=torch.ones(1, 256), layers=[1], point="mlp_post"), "point"),
        (dict(weight=torch.ones(1, D), layers=[1], point="k"), "point"),  # 2 kv heads x 32: was scored over 128
    ],
)
def test_bad_probes_are_refused_naming_the_field(llm, kwargs, field):
    with pytest.raises(ValueError) as e:
        llm.load_probe("bad", **kwargs)
    assert str(e.value).startswith(field + ":"), str(e.value)
    assert "bad" not in {p["name"] for p in llm.list_probes()}


def test_probes_at_inner_points_equal_hf(llm):
    """A probe reads the point it names: mlp_out, z (heads flattened) and mlp_in at layer 1, each equal to
    HF's value there through the probe's formula (only resid_post probes were tested)."""
    g = torch.Generator().manual_seed(9)
    ws = {p: torch.randn(2, D, generator=g) / D**0.5 for p in ("mlp_out", "z", "mlp_in")}
    try:
        for p, w in ws.items():
            llm.load_probe(f"at_{p}", weight=w, bias=torch.tensor([0.5, -0.5]), layers=[1], point=p)
        out = llm.generate([PROMPTS[2]], _sp(output_probe_scores=[f"at_{p}" for p in ws]), use_tqdm=False)[0]
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        ref, _ = point_activations(hf_model("llama"), "llama", ids[:-1])
        for p, w in ws.items():
            _check(out.activations["probe_scores"][f"at_{p}"], ref[p][1] @ w.T + torch.tensor([0.5, -0.5]))
    finally:
        for p in ws:
            llm.delete_probe(f"at_{p}")


def test_bad_requests_are_refused_and_the_engine_keeps_serving(llm, tmp_path):
    with pytest.raises(ValueError, match="path: .*has no probe.safetensors"):
        llm.load_probe("bad", str(tmp_path))
    cases = [
        (["nope"], "output_probe_scores.nope: unknown probe 'nope'"),
        ({"pr_l2": {"aggregate": ["median"]}}, r"output_probe_scores.pr_l2.aggregate\[0\]: unknown aggregate"),
        ({"pr_l2": {"positions": "later"}}, "output_probe_scores.pr_l2.positions"),
        ({"pr_l2": {"aggregates": ["max"]}}, "output_probe_scores.pr_l2: unknown fields"),
        ([], "output_probe_scores: expected"),
    ]
    for value, msg in cases:
        with pytest.raises(ValueError, match=msg):
            llm.generate([PROMPTS[0]], _sp(2, output_probe_scores=value), use_tqdm=False)
    with pytest.raises(ValueError, match="output_probe_score: unknown inspect-lens key"):
        llm.generate([PROMPTS[0]], _sp(2, output_probe_score=["pr_l2"]), use_tqdm=False)
    out = llm.generate([PROMPTS[0]], _sp(3, output_probe_scores=["pr_l2"]), use_tqdm=False)[0]
    _check(out.activations["probe_scores"]["pr_l2"], _ref("pr_l2", out))


def test_a_failure_scoring_fails_only_those_requests(llm, monkeypatch):
    plain = greedy(hf_model("llama"), list(llm.get_tokenizer()(PROMPTS[1]).input_ids), 3)
    monkeypatch.setattr(faults, "STAGE", "probes")
    with pytest.raises(HookError) as info:
        llm.generate(PROMPTS[:2], [_sp(3, output_probe_scores=["pr_l2"]), _sp(3)], use_tqdm=False)
    monkeypatch.setattr(faults, "STAGE", None)
    outs = info.value.outputs
    assert "inspect-lens internal error" in outs[0].hook_error and "scoring probes" in outs[0].hook_error
    assert outs[1].hook_error is None and list(outs[1].outputs[0].token_ids) == plain
    out = llm.generate([PROMPTS[0]], _sp(3, output_probe_scores=["pr_l2"]), use_tqdm=False)[0]
    _check(out.activations["probe_scores"]["pr_l2"], _ref("pr_l2", out))


def test_probe_only_requests_are_validated_and_admitted_once_per_list(llm):
    """A batch asking for the same probe scores and nothing else (a monitored batch) is validated once in
    the frontend (`frontend/spec_memo`) and admitted on the workers' quick path (`worker/admit_probes`),
    with scores equal to HF's; a probe loaded again under its name, or deleted, is seen by the next request
    on both sides (never the remembered probe); a request that also captures takes the general path."""
    from vllm_worker.frontend.spec_memo import Remembered
    from vllm_worker.frontend.state import engine_state
    from vllm_worker.worker import admit_probes

    w = torch.randn(1, D, generator=torch.Generator().manual_seed(5))
    sp = _sp(3, output_probe_scores=["memo_probe", "pr_l2"])

    def run(scale: float) -> None:
        before = admit_probes.COUNTS["admitted"]
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        assert admit_probes.COUNTS["admitted"] - before == len(PROMPTS)
        for out in outs:
            ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
            x, _ = residuals(hf_model("llama"), ids[:-1])
            _check(out.activations["probe_scores"]["memo_probe"], x[1] @ (scale * w).T)
            _check(out.activations["probe_scores"]["pr_l2"], _ref("pr_l2", out))
        assert sp.extra_args == {"output_probe_scores": ["memo_probe", "pr_l2"]}  # the caller's, untouched

    llm.load_probe("memo_probe", weight=w, layers=[1])
    try:
        run(1.0)
        run(1.0)
        memo = [r for r in engine_state(llm).specs.values() if isinstance(r, Remembered) and r.used]
        assert [name for name, _ in memo[-1].used] == ["memo_probe", "pr_l2"]
        llm.load_probe("memo_probe", weight=3 * w, layers=[1])  # the same name, other weights
        run(3.0)
        before = admit_probes.COUNTS["admitted"]
        both = _sp(3, output_probe_scores=["memo_probe"], output_residual_stream=[1])
        out = llm.generate([PROMPTS[0]], both, use_tqdm=False)[0]
        assert admit_probes.COUNTS["admitted"] == before  # (a capture too: the general path)
        _check(out.activations["probe_scores"]["memo_probe"], out.activations["residual_stream"][0] @ (3 * w).T)
    finally:
        llm.delete_probe("memo_probe")
    with pytest.raises(ValueError, match="output_probe_scores.memo_probe: unknown probe 'memo_probe'"):
        llm.generate([PROMPTS[0]], sp, use_tqdm=False)
    out = llm.generate([PROMPTS[1]], _sp(3, output_probe_scores=["pr_l2"]), use_tqdm=False)[0]
    _check(out.activations["probe_scores"]["pr_l2"], _ref("pr_l2", out))
