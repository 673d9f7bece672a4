"""`probe_actions` under tensor parallelism (TP=2: every rank scores and agrees; the output rank's stop
reaches the scheduler) and pipeline parallelism (PP=2, layers 2-3 on the last stage: a stop or a gated
vector whose probe layer lies on another stage is refused naming the action, never silently ignored)."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.hook_fns import PROMPT
from vllm_worker import SteeringVector
from vllm_worker.api.hooks import UnsupportedError

D = 128


def _w() -> list[float]:
    w = torch.randn(D, generator=torch.Generator().manual_seed(3))
    return (w / w.norm()).tolist()


def _sp(extra, n=10) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, extra_args=extra)


def _threshold(llama, layer: int) -> tuple[float, int]:
    """A threshold first crossed at watched index k >= 2 of the plain single-process run, and k."""
    out = llama.generate([PROMPT], _sp({"output_residual_stream": [layer]}), use_tqdm=False)[0]
    n = len(out.prompt_token_ids)
    s = (out.activations["residual_stream"][0, n - 1 :] @ torch.tensor(_w())).tolist()
    k = next(k for k in range(2, len(s) - 2) if s[k] > max(s[:k]) + 1e-2)
    return (max(s[:k]) + s[k]) / 2, k


@pytest.mark.parametrize("kind", ["tp2", "pp2"])
def test_stop_and_gated_steer_equal_the_single_engine(request, llama, kind):
    llm = request.getfixturevalue(kind)
    thr, k = _threshold(llama, 2)
    v = torch.randn(1, D, generator=torch.Generator().manual_seed(11)) * 2
    stop = {"direction": _w(), "layer": 2, "threshold": thr, "then": "stop", "name": "par"}
    steer = {**stop, "then": {"steer": SteeringVector(v, [3])}}
    sps = [_sp({"probe_actions": [stop]}), _sp({"probe_actions": [steer]})]
    want = llama.generate([PROMPT] * 2, sps, use_tqdm=False)
    got = llm.generate([PROMPT] * 2, sps, use_tqdm=False)
    assert got[0].outputs[0].stop_reason == "probe:par" and len(got[0].outputs[0].token_ids) in (k + 1, k + 2)
    for g, w in zip(got, want):
        assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids)
        (a,), (b,) = g.activations["probe_actions"], w.activations["probe_actions"]
        assert a["value"] == pytest.approx(b["value"], abs=1e-4)  # (TP's all-reduce: float rounding only)
        assert {**a, "value": None} == {**b, "value": None}


def test_actions_across_pipeline_stages_are_refused_naming_the_action(pp2):
    stop = {"direction": _w(), "layer": 1, "threshold": 0.0, "then": "stop"}
    with pytest.raises(UnsupportedError, match=r"probe_actions\[0\]: a stop needs its probe's layer on the last"):
        pp2.generate([PROMPT], _sp({"probe_actions": [stop]}), use_tqdm=False)
    steer = {**stop, "layer": 2, "then": {"steer": SteeringVector(torch.ones(1, D), [1])}}
    with pytest.raises(UnsupportedError, match=r"probe_actions\[0\]: its steering needs the probe's layer"):
        pp2.generate([PROMPT], _sp({"probe_actions": [steer]}), use_tqdm=False)
    out = pp2.generate([PROMPT], _sp(None), use_tqdm=False)[0]  # and the engine goes on
    assert len(out.outputs[0].token_ids) == 10
