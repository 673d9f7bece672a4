"""Issue #43 over HTTP where only offline was tested: a transcoder loaded by `POST /v1/lens/saes` (the kind
read from its config) gives the offline engine's features and clamped answer; a registered vector named
with an op and a phase steers exactly like the tensor inline."""

from __future__ import annotations

import json

import httpx
import torch
from vllm import SamplingParams

from support.lens_http import PROMPT, lens_client, model_name
from support.saes import random_transcoder
from support.servers import KEY, SAE_DIR
from vllm_worker import SteeringVector
from vllm_worker.api.client import decode_activations
from vllm_worker.sae import save

H = {"Authorization": f"Bearer {KEY}"}


def test_a_transcoder_over_http_equals_offline(server, llama):
    save(random_transcoder(21, 2), SAE_DIR / "tc2h")
    r = httpx.post(f"{server}/v1/lens/saes", json={"name": "tc2h", "path": "tc2h"}, headers=H, timeout=60)
    assert r.status_code == 200, r.text
    info = r.json()["sae"]
    assert (info["kind"], info["point"], info["out_point"], info["layer"]) == ("transcoder", "mlp_in", "mlp_out", 2)
    llama.load_sae("tc2h", str(SAE_DIR / "tc2h"))
    body = {"model": model_name(), "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    for xargs in (
        {"output_sae_features": {"sae": "tc2h", "top_k": 6}, "output_activations": {"mlp_out": [2]}},
        {
            "apply_sae_clamp": json.dumps([{"sae": "tc2h", "features": [5, 9], "values": [8.0, 0.0]}]),
            "output_activations": {"mlp_out": [2]},
        },
    ):
        r = httpx.post(f"{server}/v1/completions", json={**body, "vllm_xargs": xargs}, headers=H, timeout=120)
        assert r.status_code == 200, r.text
        got = decode_activations(r.json())[0]
        sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args=xargs)
        want = llama.generate([PROMPT], sp, use_tqdm=False)[0]
        assert r.json()["choices"][0]["text"] == want.outputs[0].text
        assert torch.allclose(got["mlp_out"], want.activations["mlp_out"], atol=1e-5)
        if "output_sae_features" in xargs:
            g, w = got["sae_features"]["tc2h"], want.activations["sae_features"]["tc2h"]
            assert torch.equal(g["indices"], w["indices"]) and torch.allclose(g["values"], w["values"], atol=1e-5)
    # (SAEs have no DELETE route: it stays loaded on the session server; test_saes_http, which lists the
    # server's SAEs, runs before this module)


def test_a_registered_vector_with_an_op_over_http_equals_inline(server):
    c = lens_client(server)
    d = torch.randn(128, generator=torch.Generator().manual_seed(23))
    c.register_vector("http-ablate", d)
    try:
        kw = dict(max_tokens=5, temperature=0, ignore_eos=True, capture_layers=[1, 2, 3])
        named = c.generate(
            PROMPT, steering_vectors=[SteeringVector(name="http-ablate", layer_indices=[1, 2], op="ablate")], **kw
        )
        inline = c.generate(
            PROMPT, steering_vectors=[SteeringVector(d.expand(2, 128).clone(), [1, 2], op="ablate")], **kw
        )
        capped = c.generate(
            PROMPT,
            steering_vectors=[
                SteeringVector(name="http-ablate", layer_indices=[2], op="cap", hi=0.0, phase="generated")
            ],
            **kw,
        )
        plain = c.generate(PROMPT, **kw)
        assert named.token_ids == inline.token_ids
        assert torch.equal(named.activations["residual_stream"], inline.activations["residual_stream"])
        u = d / d.norm()
        assert (named.activations["residual_stream"][:2] @ u).abs().max() <= 1e-4 * d.norm() * 10
        n = len(capped.prompt_token_ids)
        x, y = capped.activations["residual_stream"][1], plain.activations["residual_stream"][1]
        assert torch.equal(x[:n], y[:n]) and (x[n:] @ u).max() <= 1e-5  # the generated positions only
    finally:
        c.delete_vector("http-ablate")
