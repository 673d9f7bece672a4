"""SAEs over HTTP: loaded only from the operator's folder, features in the response JSON equal offline."""

from __future__ import annotations

import httpx
import torch
from vllm import SamplingParams

from support.engines import model_path
from support.saes import random_sae
from support.servers import KEY, SAE_DIR
from vllm_worker.api.client import decode_activations
from vllm_worker.sae import Sae, save

PROMPT = "the water of people will come down to the side"


def _sae() -> Sae:
    return random_sae(7, d_sae=64)


def test_sae_features_over_http_equal_offline(server, locked_server, llama):
    h = {"Authorization": f"Bearer {KEY}"}
    save(_sae(), SAE_DIR / "relu2h")
    r = httpx.post(f"{server}/v1/lens/saes", json={"name": "relu2h", "path": "relu2h"}, headers=h, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["sae"]["d_sae"] == 64
    r = httpx.post(f"{server}/v1/lens/saes", json={"name": "x", "path": "../../etc"}, headers=h, timeout=60)
    assert r.status_code == 403 and "outside the server's SAE folder" in r.text
    r = httpx.post(f"{locked_server}/v1/lens/saes", json={"name": "x", "path": str(SAE_DIR / "relu2h")}, timeout=60)
    assert r.status_code == 403 and "--lens-sae-dir" in r.text
    assert [s["name"] for s in httpx.get(f"{server}/v1/lens/saes", headers=h).json()["saes"]] == ["relu2h"]

    xargs = {"output_sae_features": {"sae": "relu2h", "top_k": 4}}
    body = {"model": str(model_path("llama")), "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{server}/v1/completions", json={**body, "vllm_xargs": xargs}, headers=h, timeout=120)
    assert r.status_code == 200, r.text
    got = decode_activations(r.json())[0]["sae_features"]["relu2h"]

    llama.load_sae("relu2h", str(SAE_DIR / "relu2h"))
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args=xargs)
    want = llama.generate([PROMPT], sp, use_tqdm=False)[0].activations["sae_features"]["relu2h"]
    assert torch.equal(got["indices"], want["indices"]) and torch.allclose(got["values"], want["values"], atol=1e-5)

    bad = {**body, "vllm_xargs": {"output_sae_features": {"sae": "nope", "top_k": 4}}}
    r = httpx.post(f"{server}/v1/completions", json=bad, headers=h, timeout=60)
    assert r.status_code == 400 and "unknown SAE 'nope'" in r.text
    assert r.json()["error"]["param"] == "vllm_xargs.output_sae_features.sae"
