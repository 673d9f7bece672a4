"""The soak's `probe` and `action` requests (bench/soak.py): a probe written with `save_probe` into the
server's `--lens-probe-dir` and loaded over `POST /v1/lens/probes`; an action threshold calibrated on the
soak's own prompts so that it fires on half of them; and the tally of what the responses say happened, so
a soak whose probes never scored or whose actions never fired does not pass as flat."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

NAME = "soak"
LAYER = 2  # the probe reads resid_post here; the steer of a fired action applies at STEER_LAYER
STEER_LAYER = 1
MAX_TOKENS = 6


def write_probe(folder: Path, d_model: int = 128) -> None:
    """A one-output logit probe at LAYER (random weights, fixed seed) in `folder / NAME`."""
    import torch

    from vllm_worker.probes import save_probe

    g = torch.Generator().manual_seed(5)
    save_probe(folder / NAME, torch.randn(1, d_model, generator=g) / d_model**0.5, torch.zeros(1), layers=[LAYER])


def load_probe(url: str, auth: dict) -> None:
    import httpx

    r = httpx.post(url + "/v1/lens/probes", json={"name": NAME, "path": NAME}, headers=auth, timeout=120)
    if r.status_code != 200:
        raise RuntimeError(f"loading the soak probe: {r.status_code} {r.text}")


def calibrate(url: str, model: str, prompts: list[str], auth: dict) -> float:
    """A threshold between the 2nd and 3rd largest of the prompts' largest watched score (the last prompt
    position onward: the positions an action reads), so a `token` action fires on 2 prompts of 4."""
    import httpx

    from vllm_worker.api.client import decode_activations

    peaks = []
    for p in prompts:
        body = {
            "model": model,
            "prompt": p,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "vllm_xargs": {"output_probe_scores": [NAME]},
        }
        r = httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=300)
        r.raise_for_status()
        scores = decode_activations(r.json())[0]["probe_scores"][NAME][:, 0]  # type: ignore[index]
        n_prompt = r.json()["usage"]["prompt_tokens"]
        peaks.append(float(scores[n_prompt - 1 :].max()))
    top = sorted(peaks, reverse=True)
    if top[1] - top[2] < 1e-2:
        raise RuntimeError(f"the soak probe's peaks per prompt are too close to split in half: {peaks}")
    print(json.dumps({"probe_peaks": peaks, "threshold": (top[1] + top[2]) / 2}), flush=True)
    return (top[1] + top[2]) / 2


def xargs(threshold: float) -> dict[str, Any]:
    """`vllm_xargs` of the two kinds; `action` alternates a stop and a steer (`pick`)."""
    import torch

    from vllm_worker.protocol.wire import tensor_to_json

    vec = torch.randn(1, 128, generator=torch.Generator().manual_seed(1)) * 2
    steer = {"activations": tensor_to_json(vec), "layer_indices": [STEER_LAYER]}
    base = {"probe": NAME, "threshold": threshold, "aggregate": "token"}
    return {
        "probe": {"output_probe_scores": json.dumps([NAME])},
        "action": [
            {"probe_actions": json.dumps([{**base, "then": "stop"}])},
            {"probe_actions": json.dumps([{**base, "then": {"steer": steer}}])},
        ],
    }


def pick(value: Any, i: int) -> Any:
    """Request i's `vllm_xargs`: a list alternates every 4 requests, so each prompt (i % 4) gets each."""
    return value[(i // 4) % len(value)] if isinstance(value, list) else value


def tally(kind: str, sent: dict, body: dict, seen: dict[str, int]) -> bool:
    """Count what a 200 response says the probe / action did; False when it lacks what was asked or the
    action's outcome does not hold together (a stop that fired before the last token ends the request
    right after the firing token; a steer never stops it)."""
    if kind not in ("probe", "action"):
        return True
    choice = body["choices"][0]
    acts = choice.get("activations") or {}
    if kind == "probe":
        ok = NAME in (acts.get("probe_scores") or {})
        seen["probes_scored"] = seen.get("probes_scored", 0) + ok
        return ok
    reports = acts.get("probe_actions") or []
    if len(reports) != 1:
        return False
    is_stop = json.loads(sent["vllm_xargs"]["probe_actions"])[0]["then"] == "stop"
    fired, k = bool(reports[0]["fired"]), int(reports[0]["token_index"])
    stopped = choice.get("stop_reason") == f"probe:{NAME}"
    n_tokens = body["usage"]["completion_tokens"]
    flavor = "stop" if is_stop else "steer"
    for key, on in ((f"actions_{flavor}", True), (f"actions_{flavor}_fired", fired), ("actions_stopped", stopped)):
        seen[key] = seen.get(key, 0) + on
    if is_stop and fired and k < MAX_TOKENS - 1:
        return stopped and n_tokens == k + 1
    return not stopped
