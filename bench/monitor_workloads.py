"""The monitor and intervention workloads (#42 probes and probe actions, #43 ops and neuron points), kept
apart from worker.py: what each request asks, the probes an engine loads for them, and what each run's
results must hold (no silent no-op).

| id | workload |
|---|---|
| W9 | 1 probe scored for every request (the middle layer) |
| W10 | 8 probes at 4 layers (2 a layer), every request |
| W11 | conditional steering: a probe action `then: steer` on every request (fires at the first watched position) |
| W12 | ablate one direction at every layer, every request |
| W12n | W12 naming a registered vector (`llm.register_vector` at start: sent by reference) |
| W13 | cap one direction at one layer, every request |
| W14 | capture `mlp_post` at one layer (an engine tapping it: the system lens-points, BENCH_LENS_POINTS=mlp_post) |
| W15 | streaming with the scores of 1 probe against plain streaming, on one server (`bench/stream_scores.py`) |
"""

from __future__ import annotations

from typing import Any

MONITOR_WORKLOADS = ("W9", "W10", "W11", "W12", "W12n", "W13", "W14")
VECTOR = "w12n_dir"  # W12n's registered vector (`register_vectors`)
NAMES = {
    "W9": "1 probe scored, every request",
    "W10": "8 probes at 4 layers, every request",
    "W11": "probe action then steer, every request",
    "W12": "ablate 1 direction at every layer",
    "W12n": "W12 by a registered name",
    "W13": "cap 1 direction at 1 layer",
    "W14": "capture mlp_post, 1 layer",
    "W15": "streaming with 1 probe vs plain streaming",
}
STREAM_WORKLOADS = ("W15",)  # over HTTP: bench/stream_scores.py runs them, not worker.py


def probe_layers(n_layers: int) -> list[int]:
    """W10's four layers, spread around the middle."""
    mid = n_layers // 2
    return sorted({max(0, mid - 6), max(0, mid - 2), min(n_layers - 1, mid + 2), min(n_layers - 1, mid + 6)})


def load_probes(llm: Any, n_layers: int, d: int) -> None:
    """The probes W9-W11 name: "m1" at the middle layer, "m8_0" .. "m8_7" two a layer at W10's layers."""
    import torch

    g = torch.Generator().manual_seed(1)
    llm.load_probe("m1", weight=torch.randn(1, d, generator=g), bias=torch.zeros(1), layers=[n_layers // 2])
    for j in range(8):
        layer = probe_layers(n_layers)[j // 2]
        llm.load_probe(f"m8_{j}", weight=torch.randn(1, d, generator=g), bias=torch.zeros(1), layers=[layer])


def register_vectors(llm: Any, vec: Any) -> None:
    """W12n's vector: W12's direction (`vec`: W3's `(1, d)` vector), registered once."""
    llm.register_vector(VECTOR, (vec / vec.norm())[0])


def extra(workload: str, n_layers: int, d: int, vec: Any, SteeringVector: Any) -> dict:
    """One request's extra_args for a monitor workload (`vec`: W3's `(1, d)` vector)."""
    mid = n_layers // 2
    unit = vec / vec.norm()
    if workload == "W9":
        return {"output_probe_scores": ["m1"]}
    if workload == "W10":
        return {"output_probe_scores": [f"m8_{j}" for j in range(8)]}
    if workload == "W11":  # fires at once: scoring and the gated vector both work every step after it
        steer = SteeringVector(activations=vec, layer_indices=[mid + 1], scale=1.0)
        return {"probe_actions": [{"probe": "m1", "threshold": -1e9, "then": {"steer": steer}}]}
    if workload == "W12":
        return {
            "apply_steering_vectors": [
                SteeringVector(
                    activations=unit.expand(n_layers, d).clone(), layer_indices=list(range(n_layers)), op="ablate"
                )
            ]
        }
    if workload == "W12n":
        return {
            "apply_steering_vectors": [SteeringVector(name=VECTOR, layer_indices=list(range(n_layers)), op="ablate")]
        }
    if workload == "W13":
        return {
            "apply_steering_vectors": [SteeringVector(activations=unit, layer_indices=[mid], op="cap", lo=-1.0, hi=1.0)]
        }
    if workload == "W14":
        return {"output_activations": {"mlp_post": [mid]}}
    raise ValueError(workload)


def check(workload: str, outs: list, prompt_len: int, new: int, d_mlp: int) -> None:
    """The results each run must carry (first request; every run, cheap)."""
    o = outs[0]
    n_pos = prompt_len + new - 1
    if workload in ("W9", "W10"):
        names = ["m1"] if workload == "W9" else [f"m8_{j}" for j in range(8)]
        for name in names:
            s = o.activations["probe_scores"][name]
            assert tuple(s.shape) == (n_pos, 1), f"{name}: scores {tuple(s.shape)}"
            assert bool(s.isfinite().all()), f"{name}: non-finite scores"
    if workload == "W11":
        got = o.activations["probe_actions"]
        assert got and got[0]["fired"], f"W11: the action did not fire: {got}"
        assert len(o.outputs[0].token_ids) == new
    if workload == "W14":
        a = o.activations["mlp_post"]
        assert tuple(a.shape) == (1, n_pos, d_mlp), f"mlp_post: {tuple(a.shape)}"
        assert bool(a.float().isfinite().all()) and float(a.float().abs().sum()) > 0


def stream_body(model: str, prompt: list[int], new: int, scored: bool) -> dict:
    """W15's streamed completion: plain, or with the scores of probe "m1" in each chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": True}
    if scored:
        body["vllm_xargs"] = {"output_probe_scores": ["m1"]}
    return body


def check_stream(chunks: list[dict], probe: str, new: int) -> None:
    """A scored stream: every chunk with tokens brings the scores up to its last token's position, and the
    chunks' scores together are the final chunk's full scores (no silent drop)."""
    import torch

    from vllm_worker.protocol.wire import from_jsonable

    bad = [c for c in chunks if "choices" not in c]
    assert not bad, f"W15: a chunk that is not a completion's: {bad[0]}"[:2000]
    final = [c for c in chunks if any("activations" in ch for ch in c["choices"])]
    assert len(final) == 1, f"W15: {len(final)} final chunks"
    full = from_jsonable(final[0]["choices"][0]["activations"]["probe_scores"][probe])
    n_prompt, n_tokens, pos, scores = 0, 0, [], []
    for c in chunks:
        for ch in c["choices"]:
            n_prompt = n_prompt or len(ch.get("prompt_token_ids") or [])
            n_tokens += len(ch.get("token_ids") or [])
            if ch.get("token_ids"):
                assert probe in ch.get("probe_scores", {}), f"W15: a chunk without scores: {ch}"
                got = ch["probe_scores"][probe]
                p = from_jsonable(got["positions"])
                assert int(p.max()) == n_prompt + n_tokens - 2, "W15: a chunk's scores stop short of its tokens"
                pos.append(p)
                scores.append(from_jsonable(got["scores"]))
    assert n_tokens == new, f"W15: {n_tokens} tokens streamed, {new} asked"
    assert torch.equal(torch.cat(pos), torch.arange(n_prompt + new - 1)), "W15: positions missing or repeated"
    assert torch.equal(torch.cat(scores), full), "W15: streamed scores differ from the final chunk's"
