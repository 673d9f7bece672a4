"""A real engine's fetches group requests by their filed entries (`probe_filing`) or, once a request's
`ProbeScores` were made, by the index kept with them (`ProbeScores.key`), never walking spans, and every
payload made either way equals the request's own
`probes.payload` bit for bit: a batch changing under its requests (4 sequences at a time for 8 requests,
requests finishing while others keep going), requests preempted and recomputed (a 128-token KV cache), a
request stopped by a string and one by a stop token (EOS's path), and a probe over several layers."""

from __future__ import annotations

import torch
from vllm import SamplingParams

from support.engines import make_engine
from vllm_worker.protocol import probe_wire
from vllm_worker.worker import probe_payloads, probes

D = 128
WORDS = "the water of people will come down to the side a long thing to see him how many water did she".split()


def _probe(seed: int, n_out: int, layers: list[int], output: str) -> dict:
    g = torch.Generator().manual_seed(seed)
    k = len(layers) * D
    return dict(
        weight=torch.randn(n_out, k, generator=g) / k**0.5,
        bias=torch.randn(n_out, generator=g),
        layers=layers,
        output=output,
    )


PROBES = {
    "ix_a": _probe(31, 2, [1], "logit"),
    "ix_b": _probe(32, 1, [2], "sigmoid"),
    "ix_ab": _probe(33, 1, [1, 2], "logit"),
}


def test_fetches_use_the_index_and_equal_each_request_alone(monkeypatch):
    llm = make_engine("llama", max_num_seqs=4, kv_cache_memory_bytes=512 << 10, max_model_len=128, block_size=32)
    for name, p in PROBES.items():
        llm.load_probe(name, **p)
    prompts = [" ".join(WORDS[i : i + 5 + i]) for i in range(8)]
    names = [
        ["ix_a", "ix_b"],
        ["ix_a"],
        ["ix_b", "ix_a"],
        ["ix_a", "ix_ab"],
        ["ix_a", "ix_b"],
        ["ix_b"],
        ["ix_a"],
        ["ix_a", "ix_b"],
    ]
    lengths = [60, 20, 90, 45, 100, 75, 25, 110]
    first = llm.generate(
        prompts[:2], [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 2, use_tqdm=False
    )
    stop_text = first[0].outputs[0].text[-6:].strip() or first[0].outputs[0].text  # met by request 0 again
    stop_token = first[1].outputs[0].token_ids[6]  # met by request 1 again: a stop token's path (as EOS)
    sps = []
    for i, (n, probe_names) in enumerate(zip(lengths, names)):
        extra = {"output_probe_scores": probe_names}
        kw = {"stop": [stop_text]} if i == 0 else {"stop_token_ids": [stop_token]} if i == 1 else {"ignore_eos": True}
        sps.append(SamplingParams(max_tokens=n, temperature=0, extra_args=extra, **kw))
    seen = {"covered": 0, "left": 0, "walks": 0, "entries": 0}
    made = probe_payloads.payloads
    walk = probe_payloads._walk

    def counted_walk(*a):
        seen["walks"] += 1
        return walk(*a)

    def checked(requests, cache, starts=None, blocks=False):
        got = made(requests, cache, starts, blocks)
        for i, (req, p) in enumerate(zip(requests, got)):
            if p is None:
                seen["left"] += 1
                continue
            seen["covered"] += 1
            if isinstance(p, tuple):  # a request's probes as one block: as its items
                p = probe_wire.items_of({"probes": p[0], probe_wire.BLOCK: p[1]})
            if type(req) is not dict:  # its `RequestResults`: read from its filed entries unless slots were made
                seen["entries"] += req._expanded == 0
                req = req.probes  # (made now: this request's later reads take its slots' index)
            alone = (
                probes.payload(req, cache={})
                if starts is None
                else probes.payload(req, starts[i], running=True, cache={})
            )
            assert p == alone and list(p) == list(alone)  # the same bytes, shapes, dtypes and order
        return got

    monkeypatch.setattr(probe_payloads, "payloads", checked)
    monkeypatch.setattr(probe_payloads, "_walk", counted_walk)
    outs = llm.generate(prompts, sps, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "stop" and len(outs[0].outputs[0].token_ids) < lengths[0]
    assert outs[1].outputs[0].finish_reason == "stop" and outs[1].outputs[0].token_ids[-1] == stop_token
    for out, probe_names in zip(outs, names):
        assert set(out.activations["probe_scores"]) == set(probe_names)
    print("\n[figures] index engine:", seen)
    assert seen["walks"] == 0  # every slot's spans covered by its index
    assert seen["covered"] > 0 and seen["left"] > 0, seen  # (the several-layer probe's request: left)
    assert seen["entries"] > 0, seen  # (fetches read requests from their entries)
