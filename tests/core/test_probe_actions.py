"""`probe_actions`: a score crossing its threshold stops the request or switches steering on, in the same
generation; equal to HF float32 with the same rule applied by hand (the firing position, the steered
continuation); batch-mates and requests whose probe never fires are unchanged."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.reference import greedy, hf_model, residuals, steer_edit
from vllm_worker import SteeringVector
from vllm_worker.counters import STEP_TIMINGS

D = 128
LAYER = 2
N_NEW = 12
PROMPTS = ["the water of people will come down to the side", "a long thing to see him", "how many water did she"]


def _direction(seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(D, generator=g)
    return v / v.norm()


def _sp(extra=None, n=N_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, extra_args=extra)


def _watched_scores(hf, prompt_ids, tokens, w, edit=None) -> list[float]:
    """The score at each position that produced a generated token (last prompt position onward)."""
    ids = list(prompt_ids) + list(tokens)
    ref, _ = residuals(hf, ids[:-1], edit)
    s = ref[LAYER] @ w
    return s[len(prompt_ids) - 1 :].tolist()


def _aggregate(scores: list[float], kind: str) -> list[float]:
    if kind == "token":
        return scores
    if kind.startswith("ema:"):
        a = float(kind[4:])
        out, e = [], 0.0
        for i, s in enumerate(scores):
            e = s if i == 0 else a * e + (1 - a) * s
            out.append(e)
        return out
    w = int(kind.split(":")[1])
    return [sum(scores[max(0, i - w + 1) : i + 1]) / min(i + 1, w) for i in range(len(scores))]


def _threshold_firing_at(agg: list[float], k: int) -> float:
    """A threshold whose first crossing is at watched index k (between the max before and agg[k])."""
    before = max(agg[:k]) if k else -1e9
    assert agg[k] > before + 1e-3, "no clean crossing at k for this direction"
    return (before + agg[k]) / 2


@pytest.fixture(scope="module")
def plain(llama):
    outs = llama.generate(PROMPTS, [_sp() for _ in PROMPTS], use_tqdm=False)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]


def _first_rise(agg: list[float]) -> int:
    """A watched index k >= 2 where agg[k] exceeds every earlier value (a crossing a threshold can catch)."""
    for k in range(2, len(agg) - 3):
        if agg[k] > max(agg[:k]) + 1e-3:
            return k
    pytest.skip("no rising score in this generation")


@pytest.mark.parametrize("aggregate", ["token", "ema:0.5", "rolling_max:3"])
def test_stop_at_the_firing_token_with_reason_and_position(llama, plain, aggregate):
    hf = hf_model("llama")
    w = _direction()
    prompt_ids, tokens = plain[0]
    agg = _aggregate(_watched_scores(hf, prompt_ids, tokens, w), aggregate)
    k = _first_rise(agg)
    thr = _threshold_firing_at(agg, k)
    act = {"direction": w.tolist(), "layer": LAYER, "threshold": thr, "aggregate": aggregate, "then": "stop"}
    act["name"] = "dir"
    outs = llama.generate([PROMPTS[0], PROMPTS[1]], [_sp({"probe_actions": [act]}), _sp()], use_tqdm=False)
    o = outs[0].outputs[0]
    got = list(o.token_ids)
    assert len(got) in (k + 1, k + 2), (len(got), k)
    assert got == tokens[: len(got)]
    assert o.finish_reason == "stop" and o.stop_reason == "probe:dir"
    (rep,) = outs[0].activations["probe_actions"]
    assert rep["fired"] and rep["name"] == "dir" and rep["action"] == 0
    assert rep["token_index"] == k and rep["position"] == len(prompt_ids) - 1 + k
    assert rep["value"] == pytest.approx(agg[k], abs=1e-4)
    # the batch-mate ran to the end as without actions
    assert list(outs[1].outputs[0].token_ids) == plain[1][1] and outs[1].outputs[0].finish_reason == "length"


def test_never_firing_equals_the_request_without_actions(llama, plain):
    w = _direction()
    act = {"direction": w.tolist(), "layer": LAYER, "threshold": 1e6, "then": "stop"}
    steer = {"steer": SteeringVector(torch.ones(1, D) * 5.0, [1])}
    acts = [act, {**act, "then": steer}]
    outs = llama.generate(PROMPTS, [_sp({"probe_actions": acts}) for _ in PROMPTS], use_tqdm=False)
    for o, (_, tokens) in zip(outs, plain):
        assert list(o.outputs[0].token_ids) == tokens
        assert o.outputs[0].finish_reason == "length" and o.outputs[0].stop_reason is None
        reps = o.activations["probe_actions"]
        assert [r["fired"] for r in reps] == [False, False] and [r["position"] for r in reps] == [-1, -1]


def _steer_firing_at_the_first_rise(plain) -> tuple:
    """(HF model, prompt ids, plain tokens, k, the vector, the action): a `then: steer` action on PROMPTS[2]
    whose threshold makes it fire at the k-th watched position (the first rise of its scores)."""
    hf = hf_model("llama")
    w = _direction()
    prompt_ids, tokens = plain[2]
    agg = _watched_scores(hf, prompt_ids, tokens, w)
    k = _first_rise(agg)
    thr = _threshold_firing_at(agg, k)
    v = torch.randn(1, D, generator=torch.Generator().manual_seed(11))
    v = v / v.norm() * 8.0
    act = {"direction": w.tolist(), "layer": LAYER, "threshold": thr, "then": {"steer": SteeringVector(v, [1])}}
    return hf, prompt_ids, tokens, k, v, act


def test_steer_switches_on_from_the_token_after_the_firing_one(llama, plain):
    hf, prompt_ids, tokens, k, v, act = _steer_firing_at_the_first_rise(plain)
    outs = llama.generate([PROMPTS[2], PROMPTS[0]], [_sp({"probe_actions": [act]}), _sp()], use_tqdm=False)
    fire_pos = len(prompt_ids) - 1 + k
    # HF: the vector at layer 1 on every position after the firing one
    positions = list(range(fire_pos + 1, len(prompt_ids) + N_NEW))
    edit = steer_edit({1: v[0].expand(len(positions), D)}, positions=positions)
    want = greedy(hf, prompt_ids, N_NEW, edit)
    got = list(outs[0].outputs[0].token_ids)
    assert got[: k + 1] == tokens[: k + 1]
    assert got == want
    assert got != tokens, "the vector is strong enough to change the continuation"
    (rep,) = outs[0].activations["probe_actions"]
    assert rep["fired"] and rep["position"] == fire_pos
    assert outs[0].outputs[0].finish_reason == "length"
    assert list(outs[1].outputs[0].token_ids) == plain[0][1]


def test_a_gated_steer_equal_to_a_batch_mates_plain_steer_still_applies(llama, plain):
    """A batch-mate admitted first stores the same vector plainly (the same content key in the shared
    entry table); the action's steering, gated per request, gets entries of its own and switches on as
    alone — never a chain found stored and left without entries (it was silently not applied)."""
    hf, prompt_ids, tokens, k, v, act = _steer_firing_at_the_first_rise(plain)
    mate = {"apply_steering_vectors": [SteeringVector(v.clone(), [1])]}
    before = dict(STEP_TIMINGS)
    outs = llama.generate([PROMPTS[0], PROMPTS[2]], [_sp(mate), _sp({"probe_actions": [act]})], use_tqdm=False)
    assert STEP_TIMINGS["graph_steps"] - before["graph_steps"] >= N_NEW - 1, "the steps ran on the Python path"
    fire_pos = len(prompt_ids) - 1 + k
    positions = list(range(fire_pos + 1, len(prompt_ids) + N_NEW))
    want = greedy(hf, prompt_ids, N_NEW, steer_edit({1: v[0].expand(len(positions), D)}, positions=positions))
    assert want != tokens, "the vector is strong enough to change the continuation"
    assert list(outs[1].outputs[0].token_ids) == want
    mate_ids = list(outs[0].prompt_token_ids)
    all_pos = list(range(len(mate_ids) + N_NEW))
    mate_want = greedy(hf, mate_ids, N_NEW, steer_edit({1: v[0].expand(len(all_pos), D)}, positions=all_pos))
    assert list(outs[0].outputs[0].token_ids) == mate_want


@pytest.mark.parametrize(
    ("action", "field"),
    [
        ({"layer": 1, "threshold": 1.0, "then": "stop"}, "probe_actions[0]"),
        ({"direction": [0.0] * 3, "layer": 1, "threshold": 1.0, "then": "stop"}, "probe_actions[0].direction"),
        ({"direction": [0.0] * D, "layer": 9, "threshold": 1.0, "then": "stop"}, "probe_actions[0].layer"),
        ({"direction": [0.0] * D, "layer": 1, "then": "stop"}, "probe_actions[0].threshold"),
        ({"direction": [0.0] * D, "layer": 1, "threshold": float("nan"), "then": "stop"}, "probe_actions[0].threshold"),
        ({"direction": [0.0] * D, "layer": 1, "threshold": 1, "aggregate": "ema:1.5", "then": "stop"}, ".aggregate"),
        ({"direction": [0.0] * D, "layer": 1, "threshold": 1, "aggregate": "mean", "then": "stop"}, ".aggregate"),
        (
            {"direction": [0.0] * D, "layer": 1, "threshold": 1, "aggregate": "rolling_max:0", "then": "stop"},
            ".aggregate",
        ),
        ({"direction": [0.0] * D, "layer": 1, "threshold": 1, "aggregate": "mean", "then": "stop"}, ".aggregate"),
        ({"direction": [0.0] * D, "layer": 1, "threshold": 1, "then": "halt"}, "probe_actions[0].then"),
        ({"direction": [0.0] * D, "layer": 1, "threshold": 1, "then": {"steer": "x"}}, "probe_actions[0].then.steer"),
        ({"probe": "nope", "threshold": 1, "then": "stop"}, "probe_actions[0].probe"),
        ({"direction": [0.0] * D, "layer": 1, "threshold": 1, "then": "stop", "thresh": 2}, "probe_actions[0]"),
    ],
)
def test_bad_actions_name_the_field_and_the_engine_goes_on(llama, plain, action, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        llama.generate([PROMPTS[0]], [_sp({"probe_actions": [action]})], use_tqdm=False)
    out = llama.generate([PROMPTS[0]], [_sp()], use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == plain[0][1]


@pytest.mark.parametrize("path", ["graph", "python"])
def test_steer_and_stop_on_either_path(llama, plain, path):
    """The same gated steer on the Python path: a head scaling by 1 (an identity) keeps the step off the
    graph-safe kernel. Both give HF's steered continuation; a stop action beside it ends the request."""
    hf = hf_model("llama")
    w = _direction()
    prompt_ids, tokens = plain[2]
    agg = _watched_scores(hf, prompt_ids, tokens, w)
    k = _first_rise(agg)
    thr = _threshold_firing_at(agg, k)
    v = torch.randn(1, D, generator=torch.Generator().manual_seed(11))
    v = v / v.norm() * 8.0
    steer = {"direction": w.tolist(), "layer": LAYER, "threshold": thr, "then": {"steer": SteeringVector(v, [1])}}
    extra = {"probe_actions": [steer]}
    if path == "python":
        extra["apply_steering_vectors"] = [SteeringVector(None, [0], point="z", heads=[0], scale=1.0)]
    fire_pos = len(prompt_ids) - 1 + k
    positions = list(range(fire_pos + 1, len(prompt_ids) + N_NEW))
    want = greedy(hf, prompt_ids, N_NEW, steer_edit({1: v[0].expand(len(positions), D)}, positions=positions))
    before = dict(STEP_TIMINGS)
    out = llama.generate([PROMPTS[2]], [_sp(extra)], use_tqdm=False)[0]
    took = "python_steps" if path == "python" else "graph_steps"
    assert STEP_TIMINGS[took] - before[took] >= N_NEW - 1, "the step ran on the other path"
    assert list(out.outputs[0].token_ids) == want
    # a stop at a later crossing of the steered run's own scores
    steered = _watched_scores(
        hf, prompt_ids, want, w, steer_edit({1: v[0].expand(len(positions), D)}, positions=positions)
    )
    j = next((j for j in range(k + 2, len(steered) - 2) if steered[j] > max(steered[:j]) + 1e-3), None)
    if j is None:
        pytest.skip("no later crossing in the steered run")
    stop = {"direction": w.tolist(), "layer": LAYER, "threshold": (max(steered[:j]) + steered[j]) / 2, "then": "stop"}
    out = llama.generate([PROMPTS[2]], [_sp({**extra, "probe_actions": [steer, stop]})], use_tqdm=False)[0]
    got = list(out.outputs[0].token_ids)
    assert len(got) in (j + 1, j + 2) and got == want[: len(got)]
    assert out.outputs[0].stop_reason == "probe:direction"
    assert [r["position"] for r in out.activations["probe_actions"]] == [fire_pos, len(prompt_ids) - 1 + j]


def test_gated_steer_by_registered_name_equals_inline(llama):
    """`then.steer` may name a registered vector; an action that fires at once (threshold below every
    score) steers from the first generated token's position on, as the inline vector does."""
    v = torch.randn(D, generator=torch.Generator().manual_seed(21))
    v = v / v.norm() * 8.0
    llama.register_vector("actions-push", v)
    try:
        base = {"direction": _direction().tolist(), "layer": LAYER, "threshold": -1e6}
        named = {**base, "then": {"steer": SteeringVector(name="actions-push", layer_indices=[1])}}
        inline = {**base, "then": {"steer": [{"activations": v[None].clone(), "layer_indices": [1]}]}}
        outs = llama.generate(
            [PROMPTS[1]] * 2, [_sp({"probe_actions": [named]}), _sp({"probe_actions": [inline]})], use_tqdm=False
        )
        assert list(outs[0].outputs[0].token_ids) == list(outs[1].outputs[0].token_ids)
        n_prompt = len(outs[0].prompt_token_ids)
        assert outs[0].activations["probe_actions"][0]["position"] == n_prompt - 1
        hf = hf_model("llama")
        positions = list(range(n_prompt, n_prompt + N_NEW))
        want = greedy(
            hf, list(outs[0].prompt_token_ids), N_NEW, steer_edit({1: v.expand(N_NEW, D)}, positions=positions)
        )
        assert list(outs[0].outputs[0].token_ids) == want
        with pytest.raises(ValueError, match=r"probe_actions\[0\]\.then\.steer\[0\]\.name"):
            bad = {**base, "then": {"steer": SteeringVector(name="not-registered", layer_indices=[1])}}
            llama.generate([PROMPTS[1]], [_sp({"probe_actions": [bad]})], use_tqdm=False)
    finally:  # (the engine is the session's: leave its registry as found)
        llama.delete_vector("actions-push")


def test_a_stopped_request_keeps_its_captures(llama, plain):
    """Captures of a request a probe stopped cover its prompt and generated tokens (less the last), as HF."""
    hf = hf_model("llama")
    w = _direction()
    prompt_ids, tokens = plain[0]
    agg = _watched_scores(hf, prompt_ids, tokens, w)
    k = _first_rise(agg)
    act = {"direction": w.tolist(), "layer": LAYER, "threshold": _threshold_firing_at(agg, k), "then": "stop"}
    out = llama.generate([PROMPTS[0]], [_sp({"probe_actions": [act], "output_residual_stream": [LAYER]})])[0]
    got = list(out.outputs[0].token_ids)
    assert out.outputs[0].stop_reason == "probe:direction" and len(got) in (k + 1, k + 2)
    acts = out.activations["residual_stream"]
    ref, _ = residuals(hf, prompt_ids + got[:-1])
    assert acts.shape[1] == len(prompt_ids) + len(got) - 1
    assert (acts[0] - ref[LAYER]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("output", ["logit", "sigmoid"])
def test_a_loaded_probe_stops_at_its_crossing(llama, plain, output):
    """`"probe": name`: a loaded probe (mean / std folded, its sigmoid when it has one) with an EMA; the
    firing position equals the probe's own formula on HF residuals through `aggregation.series`."""
    from vllm_worker.probes import Probe
    from vllm_worker.probes.aggregation import series

    hf = hf_model("llama")
    g = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(1, D, generator=g) / 4, torch.tensor([0.3])
    mean, std = torch.randn(D, generator=g) * 0.1, torch.rand(D, generator=g) + 0.5
    llama.load_probe("act-probe", weight=weight, bias=bias, layers=[LAYER], output=output, mean=mean, std=std)
    probe = Probe(weight=weight, bias=bias, layers=[LAYER], output=output, mean=mean, std=std)
    for i, (prompt_ids, tokens) in enumerate(plain):  # a generation whose EMA rises after a while
        ref, _ = residuals(hf, prompt_ids + tokens[:-1])
        agg = series(probe.score(ref[LAYER])[len(prompt_ids) - 1 :, 0], "ema:0.6").tolist()
        if any(agg[k] > max(agg[:k]) + 1e-3 for k in range(2, len(agg) - 3)):
            break
    k = _first_rise(agg)
    act = {"probe": "act-probe", "threshold": _threshold_firing_at(agg, k), "aggregate": "ema:0.6", "then": "stop"}
    out = llama.generate([PROMPTS[i]], [_sp({"probe_actions": [act], "output_probe_scores": ["act-probe"]})])[0]
    got = list(out.outputs[0].token_ids)
    assert out.outputs[0].stop_reason == "probe:act-probe" and len(got) in (k + 1, k + 2)
    assert got == tokens[: len(got)]
    (rep,) = out.activations["probe_actions"]
    assert rep["token_index"] == k and rep["value"] == pytest.approx(agg[k], abs=1e-4)
    # the scores the request also asked for are the ones the action read
    scores = out.activations["probe_scores"]["act-probe"][len(prompt_ids) - 1 :, 0]
    assert series(scores, "ema:0.6")[k].item() == pytest.approx(agg[k], abs=1e-4)
    with pytest.raises(ValueError, match=r"probe_actions\[0\]\.output: .*2 outputs"):
        llama.load_probe("two-out", weight=torch.randn(2, D), layers=[1])
        llama.generate([PROMPTS[0]], [_sp({"probe_actions": [{**act, "probe": "two-out"}]})])


@pytest.mark.parametrize("path", ["graph", "python"])
def test_a_multi_layer_probe_sums_its_layers(llama, plain, path):
    """A probe over layers 1 and 3 (concatenated): the action's score is the sum of both layers' parts,
    equal to the probe's formula on HF residuals; on both paths."""
    from vllm_worker.probes import Probe
    from vllm_worker.probes.aggregation import series

    hf = hf_model("llama")
    g = torch.Generator().manual_seed(9)
    weight, mean = torch.randn(1, 2 * D, generator=g) / 6, torch.randn(2 * D, generator=g) * 0.1
    llama.load_probe("act-two-layer", weight=weight, layers=[1, 3], mean=mean)
    probe = Probe(weight=weight, bias=torch.zeros(1), layers=[1, 3], mean=mean)
    for i, (prompt_ids, tokens) in enumerate(plain):
        ref, _ = residuals(hf, prompt_ids + tokens[:-1])
        agg = series(probe.score(torch.cat([ref[1], ref[3]], -1))[len(prompt_ids) - 1 :, 0], "rolling_max:2").tolist()
        if any(agg[k] > max(agg[:k]) + 1e-3 for k in range(2, len(agg) - 3)):
            break
    k = _first_rise(agg)
    act = {"probe": "act-two-layer", "threshold": _threshold_firing_at(agg, k), "aggregate": "rolling_max:2"}
    extra = {"probe_actions": [{**act, "then": "stop"}]}
    if path == "python":
        extra["apply_steering_vectors"] = [SteeringVector(None, [0], point="z", heads=[0], scale=1.0)]
    out = llama.generate([PROMPTS[i]], [_sp(extra)], use_tqdm=False)[0]
    got = list(out.outputs[0].token_ids)
    assert out.outputs[0].stop_reason == "probe:act-two-layer" and len(got) in (k + 1, k + 2)
    (rep,) = out.activations["probe_actions"]
    assert rep["token_index"] == k and rep["value"] == pytest.approx(agg[k], abs=1e-4)


def test_a_fault_while_acting_fails_only_that_request(llama, plain, monkeypatch):
    """Our per-step action code failing fails the requests it served (an internal error naming the stage),
    never the engine or a batch-mate."""
    from vllm_worker import HookError
    from vllm_worker.worker import faults

    act = {"direction": _direction().tolist(), "layer": LAYER, "threshold": 1e6, "then": "stop"}
    monkeypatch.setattr(faults, "STAGE", "actions")
    with pytest.raises(HookError) as info:
        llama.generate(PROMPTS[:2], [_sp({"probe_actions": [act]}), _sp()], use_tqdm=False)
    monkeypatch.setattr(faults, "STAGE", None)
    outs = info.value.outputs
    assert "inspect-lens internal error" in outs[0].hook_error and "probe actions" in outs[0].hook_error
    assert outs[1].hook_error is None and list(outs[1].outputs[0].token_ids) == plain[1][1]
    out = llama.generate([PROMPTS[0]], [_sp({"probe_actions": [act]})], use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == plain[0][1] and not out.activations["probe_actions"][0]["fired"]


def test_a_fault_reading_outcomes_tells_each_leaving_request_and_frees_their_slots(llama, plain, monkeypatch):
    """Reading the outcomes of the requests leaving in a step failing: each of them gets an internal error
    naming it (never an outcome silently missing), a plain batch-mate is untouched, and their action slots
    go back (the next request acts normally; nothing left held)."""
    from vllm_worker import HookError
    from vllm_worker.worker import faults

    act = {"direction": _direction().tolist(), "layer": LAYER, "threshold": 1e6, "then": "stop"}
    monkeypatch.setattr(faults, "STAGE", "outcomes")
    with pytest.raises(HookError) as info:
        llama.generate(
            PROMPTS[:3], [_sp({"probe_actions": [act]}), _sp(), _sp({"probe_actions": [act]})], use_tqdm=False
        )
    outs = info.value.outputs
    for o in (outs[0], outs[2]):
        # (read where their results are assembled, and again where they leave the batch: either tells it)
        assert "inspect-lens internal error" in o.hook_error and "'outcomes'" in o.hook_error
    assert outs[1].hook_error is None and list(outs[1].outputs[0].token_ids) == plain[1][1]
    # the next batch's first step releases them (reading their outcomes fails again): the step goes on
    out = llama.generate([PROMPTS[1]], [_sp()], use_tqdm=False)[0]
    monkeypatch.setattr(faults, "STAGE", None)
    assert list(out.outputs[0].token_ids) == plain[1][1]
    assert llama.collective_rpc("lens_status")[0]["action_slots"] == 0
    out = llama.generate([PROMPTS[0]], [_sp({"probe_actions": [act]})], use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == plain[0][1] and not out.activations["probe_actions"][0]["fired"]


def test_each_sample_of_n_acts_on_its_own(llama, plain):
    """`n = 2` (sampled): each child has its own actions; each stops at the first crossing of its own
    scores (HF on its own tokens), or runs to the end without one."""
    hf = hf_model("llama")
    w = _direction()
    prompt_ids, tokens = plain[0]
    agg = _watched_scores(hf, prompt_ids, tokens, w)
    thr = _threshold_firing_at(agg, _first_rise(agg))
    act = {"direction": w.tolist(), "layer": LAYER, "threshold": thr, "then": "stop"}
    sp = SamplingParams(n=2, max_tokens=N_NEW, temperature=1.0, seed=7, extra_args={"probe_actions": [act]})
    out = llama.generate([PROMPTS[0]], sp, use_tqdm=False)[0]
    assert len(out.outputs) == 2
    for o in out.outputs:
        got = list(o.token_ids)
        scores = _watched_scores(hf, prompt_ids, got, w)
        first = next((j for j, v in enumerate(scores) if v > thr), None)
        (rep,) = o.activations["probe_actions"]
        if o.stop_reason == "probe:direction":
            assert first is not None and first in (len(got) - 1, len(got) - 2) and rep["token_index"] == first
        else:
            assert o.finish_reason == "length" and (first is None or first == len(got) - 1)


def test_equal_gated_steer_actions_from_admission_templates_each_fire_on_their_own(llama, plain):
    """Three requests with one `then: steer` action (equal payloads: the second batch is admitted from an
    admission template, `put_gated` taking fresh gated entries per request) and a batch-mate steering with
    the same vector plainly: each action fires and steers as alone (HF), the plain steer applies throughout,
    and no request's gate or entries reach another's."""
    hf, prompt_ids, tokens, k, v, act = _steer_firing_at_the_first_rise(plain)
    rt = llama.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner._lens_runtime
    fire_pos = len(prompt_ids) - 1 + k
    positions = list(range(fire_pos + 1, len(prompt_ids) + N_NEW))
    want = greedy(hf, prompt_ids, N_NEW, steer_edit({1: v[0].expand(len(positions), D)}, positions=positions))
    assert want != tokens, "the vector is strong enough to change the continuation"
    mate = {"apply_steering_vectors": [SteeringVector(v.clone(), [1])]}
    mate_ids = plain[0][0]
    all_pos = list(range(len(mate_ids) + N_NEW))
    mate_want = greedy(hf, mate_ids, N_NEW, steer_edit({1: v[0].expand(len(all_pos), D)}, positions=all_pos))
    hits = rt.admission.templates.hits
    for _ in range(2):
        prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[2], PROMPTS[2]]
        sps = [_sp({"probe_actions": [dict(act)]}), _sp(mate), _sp({"probe_actions": [dict(act)]})]
        sps.append(_sp({"probe_actions": [dict(act)]}))
        outs = llama.generate(prompts, sps, use_tqdm=False)
        for i in (0, 2, 3):
            assert list(outs[i].outputs[0].token_ids) == want, f"request {i}"
            (rep,) = outs[i].activations["probe_actions"]
            assert rep["fired"] and rep["position"] == fire_pos
        assert list(outs[1].outputs[0].token_ids) == mate_want
    assert rt.admission.templates.hits - hits >= 3  # (the second batch's actions came from a template)
    assert any(t.gated for t in rt.admission.templates._memo.values())  # (their rows made once: `put_gated`)
