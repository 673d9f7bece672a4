"""`probe_actions` watching positions the action names (`positions`: every position, or a range — prompt
positions included) and acting on one output of a multi-output probe (`output`); equal to HF float32 with
the same rule applied by hand, under chunked prefill and a warm prefix cache too."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.reference import greedy, hf_model, residuals, steer_edit
from vllm_worker import SteeringVector

D = 128
LAYER = 2
N_NEW = 10
PROMPT = "how many water did she see when the people of the long thing will come down to the side"
LONG = " ".join([PROMPT] * 3)  # more tokens than a 16-token prefill chunk holds, and than a 32-token block


def _direction(seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(D, generator=g)
    return v / v.norm()


def _sp(extra=None, n=N_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, extra_args=extra)


def _scores(hf, ids: list[int], w: torch.Tensor, edit=None) -> list[float]:
    """The score at every position of `ids` but the last (the last token never runs)."""
    ref, _ = residuals(hf, ids[:-1], edit)
    return (ref[LAYER] @ w).tolist()


def _ema(scores: list[float], a: float) -> list[float]:
    out, e = [], 0.0
    for i, s in enumerate(scores):
        e = s if i == 0 else a * e + (1 - a) * s
        out.append(e)
    return out


def _rise(agg: list[float], lo: int, hi: int) -> int:
    """A position p in [lo, hi) whose value exceeds every earlier one from lo on."""
    for p in range(lo + 1, hi):
        if agg[p] > max(agg[lo:p]) + 1e-3:
            return p
    pytest.skip(f"no rising score in positions {lo}..{hi}")


@pytest.fixture(scope="module")
def plain(llama):
    (o,) = llama.generate([PROMPT], [_sp()], use_tqdm=False)
    return list(o.prompt_token_ids), list(o.outputs[0].token_ids)


def test_all_positions_fire_in_the_prompt_then_stop_or_steer(llama, plain):
    """`"positions": "all"`: a crossing at a prompt position (the prompt's forward pass) is the firing
    position; a stop ends the request at its first generated token (or second), a steer applies from the
    first generated token's position on."""
    hf = hf_model("llama")
    w = _direction()
    prompt_ids, tokens = plain
    n_prompt = len(prompt_ids)
    s = _scores(hf, prompt_ids + tokens, w)
    p = _rise(s, 0, n_prompt - 1)
    thr = (max(s[:p]) + s[p]) / 2
    act = {"direction": w.tolist(), "layer": LAYER, "threshold": thr, "positions": "all", "name": "early"}
    out = llama.generate([PROMPT], [_sp({"probe_actions": [{**act, "then": "stop"}]})], use_tqdm=False)[0]
    got = list(out.outputs[0].token_ids)
    assert out.outputs[0].stop_reason == "probe:early" and len(got) in (1, 2) and got == tokens[: len(got)]
    (rep,) = out.activations["probe_actions"]
    assert rep["fired"] and rep["position"] == p and rep["token_index"] == -1
    assert rep["value"] == pytest.approx(s[p], abs=1e-4)
    # the default ("generated") watches from the last prompt position: it fires later, or not at all
    out = llama.generate([PROMPT], [_sp({"probe_actions": [{**act, "positions": "generated", "then": "stop"}]})])[0]
    (rep,) = out.activations["probe_actions"]
    assert rep["position"] != p and (not rep["fired"] or rep["position"] >= n_prompt - 1)
    v = torch.randn(1, D, generator=torch.Generator().manual_seed(11))
    v = v / v.norm() * 8.0
    steer = {**act, "then": {"steer": SteeringVector(v, [1])}}
    out = llama.generate([PROMPT], [_sp({"probe_actions": [steer]})], use_tqdm=False)[0]
    positions = list(range(n_prompt, n_prompt + N_NEW))
    want = greedy(hf, prompt_ids, N_NEW, steer_edit({1: v[0].expand(len(positions), D)}, positions=positions))
    assert list(out.outputs[0].token_ids) == want and want != tokens
    assert out.activations["probe_actions"][0]["position"] == p


def test_a_range_watches_only_its_positions(llama, plain):
    """`{"start": a, "end": b}`: the first crossing inside [a, b), though the score exceeds the threshold
    before a; positions from b on are not watched."""
    hf = hf_model("llama")
    w = _direction(seed=4)
    prompt_ids, tokens = plain
    first = len(prompt_ids) - 1
    s = _scores(hf, prompt_ids + tokens, w)
    a, b = first + 3, first + 8
    p = _rise(s, a, b)
    thr = (max(s[a:p]) + s[p]) / 2
    act = {"direction": w.tolist(), "layer": LAYER, "threshold": thr, "positions": {"start": a, "end": b}}
    out = llama.generate([PROMPT], [_sp({"probe_actions": [{**act, "then": "stop"}]})], use_tqdm=False)[0]
    k = p - first
    got = list(out.outputs[0].token_ids)
    assert len(got) in (k + 1, k + 2) and got == tokens[: len(got)]
    (rep,) = out.activations["probe_actions"]
    assert rep["position"] == p and rep["token_index"] == k and rep["value"] == pytest.approx(s[p], abs=1e-4)
    # nothing in range exceeds a threshold above the range's maximum, whatever comes after it
    high = {**act, "threshold": max(s[a:b]) + 1e-3, "then": "stop"}
    out = llama.generate([PROMPT], [_sp({"probe_actions": [high]})], use_tqdm=False)[0]
    assert not out.activations["probe_actions"][0]["fired"] and len(out.outputs[0].token_ids) == N_NEW


def test_a_list_of_positions_and_ranges(llama, plain):
    """`[p, q, {"start": a, "end": b}]`: single prompt positions and a range of generated ones; the
    aggregate (EMA) runs over exactly those positions, in order."""
    hf = hf_model("llama")
    w = _direction(seed=5)
    prompt_ids, tokens = plain
    first = len(prompt_ids) - 1
    s = _scores(hf, prompt_ids + tokens, w)
    watched = [2, 5] + list(range(first + 2, first + 8))
    agg = _ema([s[p] for p in watched], 0.5)
    j = _rise(agg, 0, len(agg))
    thr = (max(agg[:j]) + agg[j]) / 2
    positions = [2, 5, {"start": first + 2, "end": first + 8}]
    act = {"direction": w.tolist(), "layer": LAYER, "threshold": thr, "aggregate": "ema:0.5", "positions": positions}
    out = llama.generate([PROMPT], [_sp({"probe_actions": [{**act, "then": "stop"}]})], use_tqdm=False)[0]
    (rep,) = out.activations["probe_actions"]
    assert rep["position"] == watched[j] and rep["value"] == pytest.approx(agg[j], abs=1e-4)
    got = list(out.outputs[0].token_ids)
    k = max(watched[j] - first, 0)
    assert len(got) in (k + 1, k + 2) and got == tokens[: len(got)]


def test_prompt_positions_under_chunked_prefill_and_a_warm_prefix_cache(engine_factory):
    """A prompt of several 16-token chunks whose blocks another request already put in the prefix cache:
    every prompt position is still scored (the action's request reads no cached KV), the EMA runs across
    the chunks, and the same request again gives the same outcome."""
    llm = engine_factory(
        "llama", enable_prefix_caching=True, max_num_batched_tokens=16, block_size=32, enable_chunked_prefill=True
    )
    hf = hf_model("llama")
    (o,) = llm.generate([LONG], [_sp()], use_tqdm=False)  # (warms the cache)
    prompt_ids, tokens = list(o.prompt_token_ids), list(o.outputs[0].token_ids)
    n_prompt, lo = len(prompt_ids), 10  # the range starts in the first chunk; the EMA runs across the next ones
    assert n_prompt > 40
    for seed in range(6, 40):  # a direction whose EMA reaches a new high in a later chunk of the prompt
        w = _direction(seed)
        agg = _ema(_scores(hf, prompt_ids + tokens, w)[lo:], 0.5)
        p = next((p for p in range(18 - lo, n_prompt - 1 - lo) if agg[p] > max(agg[:p]) + 1e-3), None)
        if p is not None:
            break
    assert p is not None
    thr = (max(agg[:p]) + agg[p]) / 2
    act = {
        "direction": w.tolist(),
        "layer": LAYER,
        "threshold": thr,
        "aggregate": "ema:0.5",
        "positions": {"start": lo},
    }
    reps = []
    for _ in range(2):
        out = llm.generate([LONG], [_sp({"probe_actions": [{**act, "then": "stop"}]})], use_tqdm=False)[0]
        got = list(out.outputs[0].token_ids)
        assert len(got) in (1, 2) and got == tokens[: len(got)]
        reps.append(out.activations["probe_actions"][0])
    assert reps[0] == reps[1]
    assert reps[0]["position"] == lo + p and reps[0]["value"] == pytest.approx(agg[p], abs=1e-4)


def test_one_output_of_a_multi_output_probe(llama, plain):
    """`"output": k` picks the probe's column k (named `<probe>[k]`); a multi-output probe needs it."""
    hf = hf_model("llama")
    g = torch.Generator().manual_seed(8)
    weight, bias = torch.randn(3, D, generator=g) / 4, torch.tensor([0.1, -0.2, 0.3])
    llama.load_probe("act-multi", weight=weight, bias=bias, layers=[LAYER])
    prompt_ids, tokens = plain
    first = len(prompt_ids) - 1
    ref, _ = residuals(hf, prompt_ids + tokens[:-1])
    s = (ref[LAYER] @ weight[2] + bias[2]).tolist()
    p = _rise(s, first, len(s) - 2)
    act = {"probe": "act-multi", "output": 2, "threshold": (max(s[first:p]) + s[p]) / 2, "then": "stop"}
    out = llama.generate([PROMPT], [_sp({"probe_actions": [act]})], use_tqdm=False)[0]
    got = list(out.outputs[0].token_ids)
    k = p - first
    assert out.outputs[0].stop_reason == "probe:act-multi[2]" and len(got) in (k + 1, k + 2)
    (rep,) = out.activations["probe_actions"]
    assert rep["name"] == "act-multi[2]" and rep["position"] == p and rep["value"] == pytest.approx(s[p], abs=1e-4)
    for bad in ({k: v for k, v in act.items() if k != "output"}, {**act, "output": 3}, {**act, "output": True}):
        with pytest.raises(ValueError, match=r"probe_actions\[0\]\.output"):
            llama.generate([PROMPT], [_sp({"probe_actions": [bad]})], use_tqdm=False)


@pytest.mark.parametrize(
    ("positions", "field"),
    [
        ("prompt", "probe_actions[0].positions"),
        ({"end": 4}, "probe_actions[0].positions"),
        ({"start": -1}, "probe_actions[0].positions.start"),
        ({"start": None}, "probe_actions[0].positions.start"),
        ({"start": 5, "end": 5}, "probe_actions[0].positions.end"),
        ({"start": 1, "stop": 5}, "probe_actions[0].positions"),
        ([1, "x"], "probe_actions[0].positions[1]"),
        ([1, {"start": 4, "end": 2}], "probe_actions[0].positions[1].end"),
        ([], "probe_actions[0].positions"),
        (list(range(17)), "probe_actions[0].positions"),
    ],
)
def test_bad_positions_and_outputs_name_the_field(llama, plain, positions, field):
    act = {"direction": [0.0] * D, "layer": 1, "threshold": 1.0, "positions": positions, "then": "stop"}
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        llama.generate([PROMPT], [_sp({"probe_actions": [act]})], use_tqdm=False)
    with pytest.raises(ValueError, match=r"probe_actions\[0\]\.output"):
        llama.generate([PROMPT], [_sp({"probe_actions": [{**act, "positions": "all", "output": 0}]})])
    out = llama.generate([PROMPT], [_sp()], use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == plain[1]


def test_draft_tokens_are_read_from_vllm_and_fail_loudly_if_moved(llama):
    """How many rows a decode step carries per request (`compat.draft_tokens`: the rows actions stage) is
    read from vLLM's config; a config without the field is an incompatible vLLM, never a guess."""
    from types import SimpleNamespace

    from vllm_worker import compat

    runner = llama.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    assert runner.vllm_config.speculative_config is None and compat.draft_tokens(runner) == 0
    spec = SimpleNamespace(num_speculative_tokens=3)
    assert compat.draft_tokens(SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=spec))) == 3
    with pytest.raises(compat.LensIncompatibleVLLM, match="speculative_config"):
        compat.draft_tokens(SimpleNamespace(vllm_config=SimpleNamespace()))
