"""Probes under tensor parallelism (TP=2) and pipeline parallelism (PP=2: layers 2-3 on the second stage), on
the session's parallel engines: a multi-layer probe's scores equal the HF reference and are computed on one
rank only (TP rank 0; the stage holding its layers); a probe whose layers lie on both pipeline stages is
refused naming `layers` (under TP it is served)."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.hook_fns import PROMPT
from support.probe_counts import worker_probe_counts
from support.reference import hf_model, residuals

D = 128


def _parts(layers: list[int]) -> dict:
    g = torch.Generator().manual_seed(5)
    k = D * len(layers)
    return dict(weight=torch.randn(2, k, generator=g) / k**0.5, bias=torch.randn(2, generator=g), layers=layers)


@pytest.fixture(scope="module", params=["tp2", "pp2"])
def llm(request):
    return request.param, request.getfixturevalue(request.param)


def test_multi_layer_probe_on_one_rank_equals_hf(llm):
    kind, llm = llm
    parts = _parts([2, 3])
    llm.load_probe("par23", **parts, output="sigmoid")
    before = llm.collective_rpc(worker_probe_counts)
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, extra_args={"output_probe_scores": ["par23"]})
    out = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    after = llm.collective_rpc(worker_probe_counts)
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    x, _ = residuals(hf_model("llama"), ids[:-1])
    ref = torch.sigmoid(torch.cat([x[2], x[3]], -1) @ parts["weight"].T + parts["bias"])
    got = out.activations["probe_scores"]["par23"]
    assert got.shape == ref.shape and (got - ref).abs().max() <= 1e-4
    rows = [a["rows"] - b["rows"] for a, b in zip(after, before)]
    n = len(ids) - 1
    assert rows == ([2 * n, 0] if kind == "tp2" else [0, 2 * n])  # TP: rank 0; PP: the second stage


def test_probe_across_pipeline_stages(llm):
    kind, llm = llm
    if kind == "pp2":
        with pytest.raises(ValueError, match="^layers: .*different pipeline stages"):
            llm.load_probe("par12", **_parts([1, 2]))
        assert "par12" not in {p["name"] for p in llm.list_probes()}
        return
    parts = _parts([1, 2])
    llm.load_probe("par12", **parts)
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, extra_args={"output_probe_scores": ["par12"]})
    out = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    x, _ = residuals(hf_model("llama"), ids[:-1])
    ref = torch.cat([x[1], x[2]], -1) @ parts["weight"].T + parts["bias"]
    assert (out.activations["probe_scores"]["par12"] - ref).abs().max() <= 1e-4
