"""Issue #42 §6's CPU part in the suite: 1,000 requests at 32 concurrent on a real `vllm-lens serve`, a third
with probe scores, a third with probe actions (a stop and a gated steer on the same probe; the threshold fires
on some prompts, not others), a third plain — every answer equal to the same request alone (tokens, outcomes;
scores to 1e-5), the workers' per-request state (request states, steering entries, score chunks, action slots)
back to 0, and the server's memory growing < 100 MB over the measured round (after a warm-up round)."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import torch

from support.lens_http import AUTH, model_name, rss_mb, wait_zero
from support.servers import PROBE_DIR
from vllm_worker.probes import save_probe
from vllm_worker.protocol.wire import from_jsonable, tensor_to_json

PROMPTS = [
    "the water of people will come down to the side",
    "a long thing to see him",
    "how many water did she write",
    "they said the first people could",
]
HELD = ("request_states", "steering_entries", "probe_score_chunks", "action_slots", "action_requests", "action_stops")


def _info(h: httpx.Client, url: str) -> dict:
    return h.get(url + "/v1/lens/info").json()


def test_soak_1000_requests_with_probe_scores_and_actions(server):
    g = torch.Generator().manual_seed(8)
    save_probe(PROBE_DIR / "soakp", torch.randn(1, 128, generator=g) / 4, torch.zeros(1), layers=[2])
    with httpx.Client(timeout=120, headers=AUTH) as h:
        r = h.post(server + "/v1/lens/probes", json={"name": "soakp", "path": "soakp"})
        assert r.status_code == 200, r.text
        base = {"model": model_name(), "max_tokens": 6, "temperature": 0, "ignore_eos": True}

        def body(prompt: str, xargs: dict | None) -> dict:
            return dict(base, prompt=prompt, **({"vllm_xargs": xargs} if xargs else {}))

        # the threshold: midway between two prompts' largest watched scores, so the actions fire on some only
        peaks = []
        for p in PROMPTS:
            got = h.post(server + "/v1/completions", json=body(p, {"output_probe_scores": ["soakp"]})).json()
            ch = got["choices"][0]
            s = from_jsonable(ch["activations"]["probe_scores"]["soakp"])[-6:, 0]
            peaks.append(float(s.max()))
        top = sorted(peaks)
        thr = (top[1] + top[2]) / 2
        steer = {"activations": tensor_to_json(torch.randn(1, 128, generator=g) * 4), "layer_indices": [1]}
        actions = [
            {"probe": "soakp", "threshold": thr, "then": "stop"},
            {"probe": "soakp", "threshold": thr, "then": {"steer": steer}},
        ]
        kinds = {
            "probe": {"output_probe_scores": ["soakp"]},
            "action": {"probe_actions": json.dumps(actions)},
            "plain": None,
        }

        def digest(resp: dict) -> tuple:
            ch = resp["choices"][0]
            acts = ch.get("activations") or {}
            scores = acts.get("probe_scores", {}).get("soakp")
            outcome = [(a["fired"], a["position"]) for a in acts.get("probe_actions", [])]
            return ch["text"], ch.get("finish_reason"), ch.get("stop_reason"), outcome, scores

        ref = {
            (p, k): digest(h.post(server + "/v1/completions", json=body(p, x)).json())
            for p in PROMPTS
            for k, x in kinds.items()
        }
        fired = [ref[(p, "action")][3][0][0] for p in PROMPTS]
        assert 0 < sum(fired) < len(PROMPTS), (peaks, thr)  # fires on some prompts only
        assert all(ref[(p, "probe")][4] is not None for p in PROMPTS)

    def same(got: tuple, want: tuple) -> bool:
        if got[:4] != want[:4]:
            return False
        if want[4] is None:
            return got[4] is None
        a, b = from_jsonable(got[4]), from_jsonable(want[4])
        return a.shape == b.shape and bool(torch.allclose(a, b, atol=1e-5))

    async def run(n: int) -> list[bool]:
        sem = asyncio.Semaphore(32)
        async with httpx.AsyncClient(timeout=300, headers=AUTH, limits=httpx.Limits(max_connections=32)) as c:

            async def one(i: int) -> bool:
                p, k = PROMPTS[i % len(PROMPTS)], list(kinds)[(i // len(PROMPTS)) % len(kinds)]
                async with sem:
                    r = await c.post(server + "/v1/completions", json=body(p, kinds[k]))
                return r.status_code == 200 and same(digest(r.json()), ref[(p, k)])

            return await asyncio.gather(*(one(i) for i in range(n)))

    with httpx.Client(timeout=120, headers=AUTH) as h:
        for _ in range(int(os.environ.get("SOAK_WARMUP_ROUNDS", "1"))):
            assert all(asyncio.run(run(1000)))
        assert wait_zero(server) == (0, 0, 0, 0)
        before = rss_mb(server)
        ok = asyncio.run(run(1000))
        assert wait_zero(server) == (0, 0, 0, 0)
        after = rss_mb(server)
        h.post(server + "/v1/completions", json=body(PROMPTS[0], None) | {"max_tokens": 1})  # leavers seen
        info = _info(h, server)
        print(f"\n[figures] probe soak: {sum(ok)}/1000 correct, server RSS {before:.0f} -> {after:.0f} MB")
        assert all(ok), f"{len(ok) - sum(ok)} wrong answers"
        assert {k: info[k] for k in HELD} == dict.fromkeys(HELD, 0), info
        assert after - before < 100
        assert h.delete(server + "/v1/lens/probes/soakp").status_code == 200
