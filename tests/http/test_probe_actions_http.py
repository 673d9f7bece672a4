"""`probe_actions` over HTTP (a multiprocess engine: the stop travels from the worker process to the engine
core's scheduler): finish_reason / stop_reason and the firing position in the response equal offline."""

from __future__ import annotations

import json

import httpx
import torch
from vllm import SamplingParams

from support.engines import model_path
from support.lens_http import sse_events
from support.servers import KEY, PROBE_DIR
from vllm_worker.api.client import decode_activations
from vllm_worker.probes import save_probe
from vllm_worker.protocol.wire import tensor_to_json

PROMPT = "the water of people will come down to the side"
H = {"Authorization": f"Bearer {KEY}"}


def _action(llama) -> dict:
    """A direction and a threshold that fire at the 4th generated token of the plain run (by its own scores)."""
    w = torch.randn(128, generator=torch.Generator().manual_seed(3))
    w = (w / w.norm()).tolist()
    probe = {"direction": w, "layer": 2, "threshold": 1e6, "then": "stop", "name": "dir"}
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, extra_args={"output_residual_stream": [2]})
    out = llama.generate([PROMPT], sp, use_tqdm=False)[0]
    n_prompt = len(out.prompt_token_ids)
    scores = (out.activations["residual_stream"][0, n_prompt - 1 :] @ torch.tensor(w)).tolist()
    k = next(k for k in range(2, len(scores)) if scores[k] > max(scores[:k]) + 1e-3)
    return {**probe, "threshold": (max(scores[:k]) + scores[k]) / 2, "_k": k}


def test_stop_reason_and_firing_position_over_http_equal_offline(server, llama):
    act = _action(llama)
    k = act.pop("_k")
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, extra_args={"probe_actions": [act]})
    want = llama.generate([PROMPT], sp, use_tqdm=False)[0]
    body = {
        "model": str(model_path("llama")),
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "vllm_xargs": {"probe_actions": json.dumps([act])},
    }
    r = httpx.post(f"{server}/v1/completions", json=body, headers=H, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "probe:dir"
    assert choice["text"] == want.outputs[0].text
    assert len(want.outputs[0].token_ids) in (k + 1, k + 2)
    (rep,) = decode_activations(r.json())[0]["probe_actions"]
    assert rep == want.activations["probe_actions"][0] and rep["fired"] and rep["token_index"] == k

    # streamed: the same text, and the last chunk with tokens says why it stopped
    events = [e for e in sse_events(server, "/v1/completions", {**body, "stream": True}) if e != "DONE"]
    chunks = [c for e in events for c in e.get("choices", [])]
    assert "".join(c.get("text", "") for c in chunks) == want.outputs[0].text
    last = [c for c in chunks if c.get("finish_reason")][-1]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == "probe:dir"

    bad = {**body, "vllm_xargs": {"probe_actions": json.dumps([{**act, "aggregate": "ema:2"}])}}
    r = httpx.post(f"{server}/v1/completions", json=bad, headers=H, timeout=60)
    assert r.status_code == 400 and "probe_actions[0].aggregate" in r.text

    # positions the action names (here every one, prompt included): the outcome offline gives
    wide = {**act, "positions": "all"}
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, extra_args={"probe_actions": [wide]})
    want = llama.generate([PROMPT], sp, use_tqdm=False)[0]
    r = httpx.post(
        f"{server}/v1/completions",
        json={**body, "vllm_xargs": {"probe_actions": json.dumps([wide])}},
        headers=H,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want.outputs[0].text
    assert decode_activations(r.json())[0]["probe_actions"] == want.activations["probe_actions"]
    bad_positions = (  # (JSON in a string: vLLM's 64-bit check of extra_args never sees these ints; review3)
        ({"start": 3, "end": 2}, "positions.end"),
        ("prompt", "positions"),
        ([2**63], "positions[0]"),
        ({"start": 2**70}, "positions.start"),
    )
    for value, field in bad_positions:
        bad = {**body, "vllm_xargs": {"probe_actions": json.dumps([{**act, "positions": value}])}}
        r = httpx.post(f"{server}/v1/completions", json=bad, headers=H, timeout=60)
        assert r.status_code == 400 and f"probe_actions[0].{field}" in r.text


def test_info_counts_what_probes_and_actions_hold_while_a_request_runs(server):
    """`/v1/lens/info` counts the workers' per-request state of probe scores and actions (the soak reads
    these): held while the request streams, all 0 once it has left and one more step ran — a one-step plain
    request, whose batch has as many requests as the one that left."""
    g = torch.Generator().manual_seed(4)
    save_probe(PROBE_DIR / "pinfo", torch.randn(1, 128, generator=g), layers=[2])
    r = httpx.post(f"{server}/v1/lens/probes", json={"name": "pinfo", "path": "pinfo"}, headers=H, timeout=60)
    assert r.status_code == 200, r.text
    try:
        steer = {"activations": tensor_to_json(torch.randn(1, 128, generator=g)), "layer_indices": [1]}
        never = [
            {"probe": "pinfo", "threshold": 1e9, "then": "stop"},
            {"probe": "pinfo", "threshold": 1e9, "then": {"steer": steer}},
        ]
        body = {
            "model": str(model_path("llama")),
            "prompt": PROMPT,
            "max_tokens": 400,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "vllm_xargs": {"output_probe_scores": json.dumps(["pinfo"]), "probe_actions": json.dumps(never)},
        }
        during, after_info = None, 0
        with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=H, timeout=300) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if not line.startswith("data: {"):
                    continue
                if during is None:
                    during = httpx.get(f"{server}/v1/lens/info", headers=H, timeout=60).json()
                else:
                    after_info += 1
        assert after_info > 0  # the counts were read while it ran
        assert during is not None and during["request_states"] == 1, during
        assert (during["action_slots"], during["action_requests"]) == (2, 1), during
        assert during["steering_entries"] >= 1 and during["probe_score_chunks"] >= 1, during

        plain = {k: body[k] for k in ("model", "prompt", "temperature")}
        assert httpx.post(f"{server}/v1/completions", json={**plain, "max_tokens": 1}, headers=H).status_code == 200
        info = httpx.get(f"{server}/v1/lens/info", headers=H, timeout=60).json()
        held = ("request_states", "steering_entries", "probe_score_chunks", "action_slots", "action_requests")
        held += ("steering_shared_chains",)
        assert {k: info[k] for k in (*held, "action_stops")} == dict.fromkeys((*held, "action_stops"), 0), info
        assert isinstance(info["steer_table_full"], int) and info["steer_table_full"] >= 0, info  # cumulative
    finally:  # (the server is the session's: its probe list is checked elsewhere)
        assert httpx.delete(f"{server}/v1/lens/probes/pinfo", headers=H, timeout=60).status_code == 200
