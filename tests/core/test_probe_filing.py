"""Probe scores and SAE features filed once per site and step for the whole batch (`worker/step_records`),
each request's part cut out at fetch: many requests naming different probes in one engine whose batch
changes under them — requests joining as others finish (4 sequences at a time for 9 requests) and requests
preempted and recomputed (a KV cache of 128 tokens) — each get exactly their own scores, equal to HF's
float32 residuals through the probe by hand at every prompt and generated position, and their own SAE
features equal to a torch encode; the per-step work is one projection per site; nothing is left held."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.engines import make_engine
from support.reference import hf_model, residuals
from support.saes import random_sae, ref_encode, save_with
from vllm_worker import counters
from vllm_worker.worker.probes import PROBE_COUNTS

D = 128
WORDS = "the water of people will come down to the side a long thing to see him how many water did she".split()


def _probe(seed: int, n_out: int, layers: list[int], output: str, normed: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    k = len(layers) * D
    out = dict(weight=torch.randn(n_out, k, generator=g) / k**0.5, bias=torch.randn(n_out, generator=g))
    if normed:
        out.update(mean=torch.randn(k, generator=g) * 0.1, std=torch.rand(k, generator=g) + 0.5)
    return dict(out, layers=layers, output=output)


PROBES = {
    "f_l0": _probe(11, 3, [0], "logit", False),
    "f_l13": _probe(12, 1, [1, 3], "sigmoid", True),
    "f_l2": _probe(13, 2, [2], "logit", True),
    "f_all": _probe(14, 1, [0, 1, 2, 3], "sigmoid", False),
}
SAE = random_sae(21, "resid_post", 2, "standard", 0, 256)
# (probes, SAE use, max_tokens) per request; None: a plain batch-mate
REQUESTS = [
    (["f_l0", "f_l13", "f_l2", "f_all"], None, 60),
    (["f_l2"], {"sae": "fsae", "top_k": 8}, 20),
    (None, None, 30),
    (["f_all", "f_l0"], None, 90),
    (["f_l13"], {"sae": "fsae", "features": [3, 70, 200]}, 45),
    (["f_l0", "f_l2"], None, 100),
    (["f_l2", "f_l13", "f_all"], {"sae": "fsae", "top_k": 4}, 75),
    (["f_l0"], None, 25),
    (["f_l13", "f_l0"], None, 110),
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    # 4 sequences at a time: later requests join a running batch; 128 tokens of KV cache: running requests
    # are preempted and recomputed
    engine = make_engine("llama", max_num_seqs=4, kv_cache_memory_bytes=512 << 10, max_model_len=128, block_size=32)
    for name, p in PROBES.items():
        engine.load_probe(name, **p)
    engine.load_sae("fsae", save_with(SAE, tmp_path_factory.mktemp("filing") / "fsae"))
    return engine


def _ref(name: str, streams: dict) -> torch.Tensor:
    p = PROBES[name]
    x = torch.cat([streams[l] for l in p["layers"]], dim=-1)
    if "mean" in p:
        x = (x - p["mean"]) / p["std"]
    y = x @ p["weight"].T + p["bias"]
    return torch.sigmoid(y) if p["output"] == "sigmoid" else y


def test_each_request_gets_its_own_scores_as_the_batch_changes(llm):
    prompts = [" ".join(WORDS[i : i + 4 + i]) for i in range(len(REQUESTS))]
    sps = []
    for probes, sae, n in REQUESTS:
        extra = {} if probes is None else {"output_probe_scores": probes}
        if sae is not None:
            extra["output_sae_features"] = sae
        sps.append(SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, extra_args=extra or None))
    before = dict(PROBE_COUNTS)
    steps0 = counters.STEP_TIMINGS["graph_steps"] + counters.STEP_TIMINGS["python_steps"]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    steps = counters.STEP_TIMINGS["graph_steps"] + counters.STEP_TIMINGS["python_steps"] - steps0
    for (probes, sae, n), out in zip(REQUESTS, outs):
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        assert len(out.outputs[0].token_ids) == n
        if probes is None:
            assert out.activations is None
            continue
        streams, _ = residuals(hf_model("llama"), ids[:-1])
        got = out.activations["probe_scores"]
        assert set(got) == set(probes)
        for name in probes:
            ref = _ref(name, streams)
            assert got[name].dtype == torch.float32 and got[name].shape == ref.shape, name
            assert (got[name] - ref).abs().max() <= 1e-4, (name, (got[name] - ref).abs().max())
        if sae is not None:
            feats = out.activations["sae_features"]["fsae"]
            ref = ref_encode(SAE, streams[2])
            assert torch.equal(feats["positions"], torch.arange(len(ids) - 1))
            if "top_k" in sae:
                k = sae["top_k"]
                assert (feats["values"] - ref.topk(k, dim=-1).values).abs().max() <= 1e-4
                assert (ref.gather(1, feats["indices"]) - feats["values"]).abs().max() <= 1e-4
            else:
                assert feats["indices"].tolist() == sae["features"]
                assert (feats["values"] - ref[:, sae["features"]]).abs().max() <= 1e-4
    # one projection per site and step, whatever the requests and probes; more rows scored than positions
    # exist: some were recomputed after a preemption (the last run is the one returned, checked above)
    assert 0 < PROBE_COUNTS["projections"] - before["projections"] <= 4 * steps
    scored = PROBE_COUNTS["rows"] - before["rows"]
    per_site: dict[int, int] = {}  # positions each site scores once
    for (probes, _, n), o in zip(REQUESTS, outs):
        for s in sorted({l for name in probes or () for l in PROBES[name]["layers"]}):
            per_site[s] = per_site.get(s, 0) + len(o.prompt_token_ids) + n - 1
    assert scored > sum(per_site.values()), "no request was preempted and recomputed"
    assert llm.collective_rpc("lens_status")[0]["probe_score_chunks"] == 0
