"""Probes over HTTP: loaded only from the operator's folder (`--lens-probe-dir`), listed and deleted; the
scores and aggregates in each choice equal the offline engine's (decoded by `decode_activations`, as
`LensClient` does); an unknown probe is a 400 naming the field."""

from __future__ import annotations

import httpx
import torch
from vllm import SamplingParams

from support.engines import model_path
from support.servers import KEY, PROBE_DIR
from vllm_worker import envs
from vllm_worker.api.client import decode_activations, decode_stream_chunk
from vllm_worker.probes import save_probe

PROMPT = "the water of people will come down to the side"


def _save(name: str, layers: list[int], output: str) -> None:
    g = torch.Generator().manual_seed(11)
    k = 128 * len(layers)
    save_probe(
        PROBE_DIR / name,
        torch.randn(2, k, generator=g) / k**0.5,
        torch.randn(2, generator=g),
        layers=layers,
        output=output,
        aggregate=["ema:0.9"],
        std=torch.rand(k, generator=g) + 0.5,
    )


def test_probe_scores_over_http_equal_offline(server, locked_server, llama):
    h = {"Authorization": f"Bearer {KEY}"}
    _save("p2h", [2], "logit")
    _save("p13h", [1, 3], "sigmoid")
    for name in ("p2h", "p13h"):
        r = httpx.post(f"{server}/v1/lens/probes", json={"name": name, "path": name}, headers=h, timeout=60)
        assert r.status_code == 200, r.text
    assert r.json()["probe"]["layers"] == [1, 3] and r.json()["probe"]["hash"]
    r = httpx.post(f"{server}/v1/lens/probes", json={"name": "x", "path": "../../etc"}, headers=h, timeout=60)
    assert r.status_code == 403 and "outside the server's probe folder" in r.text
    r = httpx.post(f"{locked_server}/v1/lens/probes", json={"name": "x", "path": str(PROBE_DIR / "p2h")}, timeout=60)
    assert r.status_code == 403 and "--lens-probe-dir" in r.text
    r = httpx.post(f"{server}/v1/lens/probes", json={"name": "x", "path": "missing"}, headers=h, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"
    listed = httpx.get(f"{server}/v1/lens/probes", headers=h).json()["probes"]
    assert sorted(p["name"] for p in listed) == ["p13h", "p2h"]

    xargs = {"output_probe_scores": {"p2h": {"aggregate": ["rolling_max:2"]}, "p13h": {}}}
    body = {"model": str(model_path("llama")), "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{server}/v1/completions", json={**body, "vllm_xargs": xargs}, headers=h, timeout=120)
    assert r.status_code == 200, r.text
    got = decode_activations(r.json())[0]

    for name in ("p2h", "p13h"):
        llama.load_probe(name, str(PROBE_DIR / name))
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args=xargs)
    want = llama.generate([PROMPT], sp, use_tqdm=False)[0].activations
    for name in ("p2h", "p13h"):
        assert got["probe_scores"][name].shape == want["probe_scores"][name].shape
        assert torch.allclose(got["probe_scores"][name], want["probe_scores"][name], atol=1e-5)
        assert list(got["probe_aggregates"][name]) == list(want["probe_aggregates"][name])
        for k, v in want["probe_aggregates"][name].items():
            assert torch.allclose(got["probe_aggregates"][name][k], v, atol=1e-5), k
    assert list(got["probe_aggregates"]["p2h"]) == ["mean", "max", "last", "ema:0.9", "rolling_max:2"]

    # a list of names as vLLM's flat vllm_xargs takes it
    r = httpx.post(
        f"{server}/v1/completions",
        json={**body, "vllm_xargs": {"output_probe_scores": ["p2h"]}},
        headers=h,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert torch.allclose(
        decode_activations(r.json())[0]["probe_scores"]["p2h"], want["probe_scores"]["p2h"], atol=1e-5
    )

    bad = {**body, "vllm_xargs": {"output_probe_scores": ["nope"]}}
    r = httpx.post(f"{server}/v1/completions", json=bad, headers=h, timeout=60)
    assert r.status_code == 400 and "unknown probe 'nope'" in r.text
    assert r.json()["error"]["param"] == "vllm_xargs.output_probe_scores.nope"

    assert httpx.delete(f"{server}/v1/lens/probes/p13h", headers=h).status_code == 200
    r = httpx.delete(f"{server}/v1/lens/probes/p13h", headers=h)
    assert r.status_code == 404 and r.json()["error"]["param"] == "name"
    assert [p["name"] for p in httpx.get(f"{server}/v1/lens/probes", headers=h).json()["probes"]] == ["p2h"]


def test_streamed_chunks_carry_their_scores(server):
    """Each chunk that brings tokens brings the scores of the positions that produced them (the first one also
    the prompt's); together they are the full scores of the extra chunk before [DONE]."""
    import json

    from vllm_worker.protocol.wire import from_jsonable

    h = {"Authorization": f"Bearer {KEY}"}
    _save("p2s", [2], "logit")
    r = httpx.post(f"{server}/v1/lens/probes", json={"name": "p2s", "path": "p2s"}, headers=h, timeout=60)
    assert r.status_code == 200, r.text
    body = {
        "model": str(model_path("llama")),
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "vllm_xargs": {"output_probe_scores": ["p2s"]},
    }
    chunks = []
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=h, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    final = [c for c in chunks if any("activations" in ch for ch in c["choices"])]
    assert len(final) == 1
    full = from_jsonable(final[0]["choices"][0]["activations"]["probe_scores"]["p2s"])
    n_prompt, n_tokens, pos, scores = None, 0, [], []
    for c in chunks:
        for ch in c["choices"]:
            n_prompt = n_prompt or len(ch.get("prompt_token_ids") or [])
            n_tokens += len(ch.get("token_ids") or [])
            if "probe_scores" in ch:
                got = ch["probe_scores"]["p2s"]
                p = from_jsonable(got["positions"])
                assert int(p.max()) == n_prompt + n_tokens - 2  # up to the position that produced its last token
                pos.append(p)
                scores.append(from_jsonable(got["scores"]))
    assert n_tokens == 6 and len(pos) >= 2
    assert torch.equal(torch.cat(pos), torch.arange(n_prompt + 5))
    assert torch.equal(torch.cat(scores), full)
    # the client's decoder gives the same: each chunk's scores, then the final chunk's full scores
    decoded = [decode_stream_chunk(c) for c in chunks]
    per_chunk = [d[0]["probe_scores"]["p2s"] for d in decoded if d and "probe_scores" in d[0]]
    assert len(per_chunk) == len(pos) and all("probe_scores_error" not in d.get(0, {}) for d in decoded)
    assert torch.equal(torch.cat([c["positions"] for c in per_chunk]), torch.arange(n_prompt + 5))
    assert torch.equal(torch.cat([c["scores"] for c in per_chunk]), full)
    (last,) = [d[0]["activations"] for d in decoded if d and "activations" in d[0]]
    assert torch.equal(last["probe_scores"]["p2s"], full) and set(last["probe_aggregates"]["p2s"]) >= {"mean"}


def test_concurrent_streams_share_progress_rpcs(server):
    """Streams asking for scores at the same time share the progress RPCs (one serves the chunks of many
    streams: `server.probe_progress`), and each stream still gets exactly its own scores, chunk by chunk."""
    import asyncio
    import json

    from vllm_worker.protocol.wire import from_jsonable

    h = {"Authorization": f"Bearer {KEY}"}
    _save("p2c", [2], "logit")
    r = httpx.post(f"{server}/v1/lens/probes", json={"name": "p2c", "path": "p2c"}, headers=h, timeout=60)
    assert r.status_code == 200, r.text
    prompts = [PROMPT, "a b c d", "once upon a time there", "the cat", "one two three four five six", "hello"]
    info = httpx.get(f"{server}/v1/lens/info", headers=h, timeout=60).json()
    before, fetched_before = info["stream_progress"], info["fetch_batches"]

    async def one(client: httpx.AsyncClient, prompt: str) -> list[dict]:
        body = {
            "model": str(model_path("llama")),
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "vllm_xargs": {"output_probe_scores": ["p2c"]},
        }
        chunks = []
        async with client.stream("POST", f"{server}/v1/completions", json=body, headers=h) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        return chunks

    async def all_streams() -> list[list[dict]]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    n_chunks = 0
    for chunks in asyncio.run(all_streams()):
        final = [c for c in chunks if any("activations" in ch for ch in c["choices"])]
        assert len(final) == 1
        full = from_jsonable(final[0]["choices"][0]["activations"]["probe_scores"]["p2c"])
        n_prompt, n_tokens, pos, scores = None, 0, [], []
        for c in chunks:
            for ch in c["choices"]:
                n_prompt = n_prompt or len(ch.get("prompt_token_ids") or [])
                n_tokens += len(ch.get("token_ids") or [])
                n_chunks += bool(ch.get("token_ids"))
                if "probe_scores" in ch:
                    p = from_jsonable(ch["probe_scores"]["p2c"]["positions"])
                    assert int(p.max()) == n_prompt + n_tokens - 2
                    pos.append(p)
                    scores.append(from_jsonable(ch["probe_scores"]["p2c"]["scores"]))
        assert n_tokens == 8
        assert torch.equal(torch.cat(pos), torch.arange(n_prompt + 7))
        assert torch.equal(torch.cat(scores), full)
    info = httpx.get(f"{server}/v1/lens/info", headers=h, timeout=60).json()
    after, fetched = info["stream_progress"], info["fetch_batches"]
    rpcs, asks = after["rpcs"] - before["rpcs"], after["asks"] - before["asks"]
    assert asks == n_chunks  # every chunk that brought tokens asked once
    assert rpcs < asks, (rpcs, asks)  # ... and RPCs served several streams' chunks at once
    # the streams end in the same step: their final fetches (full scores, aggregates) share round trips,
    # each still getting its own results (checked above against its chunks)
    batches, fetches = fetched["batches"] - fetched_before["batches"], fetched["fetches"] - fetched_before["fetches"]
    assert fetches == len(prompts) and batches < fetches, (batches, fetches)
    # each RPC is followed by a pause (paced: VLLM_LENS_STREAM_PACE), never longer than the setting's cap
    paused = after["pause_s"] - before["pause_s"]
    assert 0 < paused <= rpcs * envs.get("VLLM_LENS_STREAM_MAX_PAUSE_MS") / 1000 + 1e-9, (paused, rpcs)
    assert after["rpc_s"] > before["rpc_s"]
    assert httpx.delete(f"{server}/v1/lens/probes/p2c", headers=h).status_code == 200


def test_load_without_replace_never_swaps_a_different_probe(server):
    """`"replace": false`: a name loaded with other weights is a 409 naming `name` (the loaded probe stays);
    the same weights again are a no-op 200; `replace` must be a boolean."""
    h = {"Authorization": f"Bearer {KEY}"}
    _save("p2r", [2], "logit")
    _save("p1r", [1], "logit")
    url = f"{server}/v1/lens/probes"
    r = httpx.post(url, json={"name": "pr", "path": "p2r", "replace": False}, headers=h, timeout=60)
    assert r.status_code == 200, r.text
    first = r.json()["probe"]["hash"]
    r = httpx.post(url, json={"name": "pr", "path": "p1r", "replace": False}, headers=h, timeout=60)
    assert r.status_code == 409 and r.json()["error"]["param"] == "name", r.text
    assert first in r.json()["error"]["message"]
    listed = {p["name"]: p for p in httpx.get(url, headers=h).json()["probes"]}
    assert listed["pr"]["hash"] == first and listed["pr"]["layers"] == [2]
    r = httpx.post(url, json={"name": "pr", "path": "p2r", "replace": False}, headers=h, timeout=60)
    assert r.status_code == 200 and r.json()["probe"]["hash"] == first
    r = httpx.post(url, json={"name": "pr", "path": "p1r", "replace": "no"}, headers=h, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "replace"
    r = httpx.post(url, json={"name": "pr", "path": "p1r"}, headers=h, timeout=60)  # replace: true by default
    assert r.status_code == 200 and r.json()["probe"]["layers"] == [1]
    assert httpx.delete(f"{url}/pr", headers=h).status_code == 200


def test_bad_probe_folders_are_400_naming_the_field_and_the_server_keeps_serving(server):
    """Issue #42 §1 over HTTP: a width that is not the model's, a layer out of range, an unknown point, NaN
    weights, a mean of the wrong shape, a damaged probe.json — each a 400 whose `param` names the field, nothing
    loaded under the name; then a good probe loads and scores."""
    import json

    from safetensors.torch import save_file

    h = {"Authorization": f"Bearer {KEY}"}
    url = f"{server}/v1/lens/probes"
    w = torch.ones(1, 128)
    save_probe(PROBE_DIR / "bad-width", torch.ones(1, 129), layers=[1])
    save_probe(PROBE_DIR / "bad-layer", w, layers=[9])
    folder = save_probe(PROBE_DIR / "bad-point", w, layers=[1])
    cfg = json.loads((folder / "probe.json").read_text())
    (folder / "probe.json").write_text(json.dumps({**cfg, "point": "resid_pots"}))
    folder = save_probe(PROBE_DIR / "bad-nan", w, layers=[1])
    save_file({"weight": torch.full((1, 128), float("nan")), "bias": torch.zeros(1)}, str(folder / "probe.safetensors"))
    folder = save_probe(PROBE_DIR / "bad-mean", w, layers=[1])
    save_file({"weight": w, "bias": torch.zeros(1), "mean": torch.zeros(64)}, str(folder / "probe.safetensors"))
    folder = save_probe(PROBE_DIR / "bad-json", w, layers=[1])
    (folder / "probe.json").write_text(json.dumps({**cfg, "layers": [1], "thresold": 1.0}))
    cases = [
        ("bad-width", "weight", "d_model 128"),
        ("bad-layer", "layers[0]", "out of range"),
        ("bad-point", "point", "resid_pots"),
        ("bad-nan", "weight", "NaN"),
        ("bad-mean", "mean", "(128,)"),
        ("bad-json", "probe.json", "thresold"),
    ]
    for path, param, words in cases:
        r = httpx.post(url, json={"name": "badp", "path": path}, headers=h, timeout=60)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], (path, err)
    assert "badp" not in {p["name"] for p in httpx.get(url, headers=h).json()["probes"]}
    _save("p2ok", [2], "logit")
    assert httpx.post(url, json={"name": "badp", "path": "p2ok"}, headers=h, timeout=60).status_code == 200
    body = {"model": str(model_path("llama")), "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    r = httpx.post(
        f"{server}/v1/completions",
        json={**body, "vllm_xargs": {"output_probe_scores": ["badp"]}},
        headers=h,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert decode_activations(r.json())[0]["probe_scores"]["badp"].shape[1] == 2
    assert httpx.delete(f"{url}/badp", headers=h).status_code == 200
