"""A probe action on a loaded probe at an inner point (issue #42 §3: "a loaded probe's name, read at its
point"): the action fires at the first crossing of the scores the same probe returns for the same request,
and a stop ends the request there (only resid_post probes were tested with actions)."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

PROMPT = "the water of people will come"
N = 10


def _sp(extra: dict) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, extra_args=extra)


@pytest.mark.parametrize("point, seed", [("mlp_out", 4), ("z", 1), ("attn_out", 1)])
def test_a_stop_on_an_inner_point_probe_fires_at_its_scores_crossing(llama, point, seed):
    w = torch.randn(1, 128, generator=torch.Generator().manual_seed(seed))
    name = f"act_{point}"
    llama.load_probe(name, weight=w, layers=[1], point=point)
    try:
        out = llama.generate([PROMPT], _sp({"output_probe_scores": [name]}), use_tqdm=False)[0]
        n = len(out.prompt_token_ids)
        s = out.activations["probe_scores"][name][n - 1 :, 0]  # the watched positions
        rises = [i for i in range(1, len(s) - 1) if s[i] > s[:i].max() + 1e-3]
        if not rises:
            pytest.skip("no rising score")
        k = rises[0]
        thr = float((s[:k].max() + s[k]) / 2)
        act = {"probe": name, "threshold": thr, "then": "stop"}
        o = llama.generate([PROMPT], _sp({"probe_actions": [act]}), use_tqdm=False)[0]
        (rep,) = o.activations["probe_actions"]
        assert rep["fired"] and rep["token_index"] == k and rep["position"] == n - 1 + k
        assert rep["value"] == pytest.approx(float(s[k]), abs=1e-4)
        assert o.outputs[0].stop_reason == f"probe:{name}" and len(o.outputs[0].token_ids) == k + 1
        assert list(o.outputs[0].token_ids) == list(out.outputs[0].token_ids)[: k + 1]
    finally:
        llama.delete_probe(name)
