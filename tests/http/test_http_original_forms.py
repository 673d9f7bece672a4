"""The original project's client shapes and request forms, sent to a real `vllm-lens serve`, give our numbers."""

from __future__ import annotations

import base64
import json

import httpx
import torch

from support.lens_http import PROMPT, lens_client, model_name, offline, post_json
from support.servers import KEY
from vllm_worker import Hook, SteeringVector
from vllm_worker.api.client import LensClient
from vllm_worker.protocol.wire import from_jsonable


def _ablate(ctx, h):
    h = h.clone()
    h[:, 0] = 0
    ctx.saved["calls"] = ctx.saved.get("calls", 0) + 1
    return h


def test_client_shapes_of_the_original(server, llama):
    """`VLLMLensClient` (the original's name) with `.chat()`, the model found through /v1/models, logprobs
    when asked, and `decode_activations` on a raw JSON response: same numbers as offline."""
    from vllm_worker import VLLMLensClient, decode_activations

    c = VLLMLensClient(server, api_key=KEY)  # no model given: read from /v1/models
    messages = [{"role": "user", "content": "the people will come"}]
    r = c.chat(
        messages, max_tokens=5, temperature=0, ignore_eos=True, capture_layers=[1], logprobs=True, top_logprobs=2
    )
    assert c.model == model_name()
    ref = offline(llama, messages, output_residual_stream=[1])
    assert r.token_ids == list(ref.outputs[0].token_ids)
    assert torch.equal(r.activations["residual_stream"], ref.activations["residual_stream"])
    assert len(r.logprobs["content"]) == 5 and len(r.logprobs["content"][0]["top_logprobs"]) == 2
    raw = httpx.post(
        server + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
        json={
            "model": model_name(),
            "prompt": PROMPT,
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 1,
            "vllm_xargs": {"output_residual_stream": [0, 3]},
        },
    ).json()
    acts = decode_activations(raw)
    want = offline(llama, PROMPT, output_residual_stream=[0, 3])
    assert acts[0]["layers"] == [0, 3] and torch.equal(acts[0]["residual_stream"], want.activations["residual_stream"])
    assert c.generate(PROMPT, max_tokens=3, logprobs=1).logprobs["token_logprobs"][0] <= 0


def test_model_dump_of_a_steering_vector_is_an_accepted_wire_form(server, llama):
    """`SteeringVector.model_dump()` is JSON: sent as is in `vllm_xargs` it steers exactly like the
    object offline."""
    from vllm_worker import SteeringVector

    sv = SteeringVector(torch.randn(1, 128, generator=torch.Generator().manual_seed(4)) * 5, [1], scale=1.5)
    body = {
        "model": model_name(),
        "prompt": PROMPT,
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "vllm_xargs": {"apply_steering_vectors": json.dumps([sv.model_dump()]), "output_residual_stream": [2]},
    }
    raw = httpx.post(
        server + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=60
    ).json()
    from vllm_worker import decode_activations

    want = offline(llama, PROMPT, apply_steering_vectors=[sv], output_residual_stream=[2])
    assert raw["choices"][0]["token_ids"] == list(want.outputs[0].token_ids)
    assert torch.equal(decode_activations(raw)[0]["residual_stream"], want.activations["residual_stream"])


def test_the_original_request_forms_give_our_numbers(server, llama):
    """The original vllm-lens's wire forms — a zstd tensor object for a steering vector, a hook as
    `{"fn": {"cloudpickle": ...}}` — decode to exactly what our own forms do."""
    import cloudpickle
    import zstandard

    from vllm_worker import decode_activations

    v = torch.randn(1, 128, generator=torch.Generator().manual_seed(8)) * 5
    original_vec = {
        "data": base64.b64encode(zstandard.ZstdCompressor(level=1).compress(v.numpy().tobytes())).decode(),
        "dtype": "float32",
        "original_dtype": "torch.float32",
        "shape": [1, 128],
        "compression": "zstd",
    }
    fn = base64.b64encode(cloudpickle.dumps(_ablate)).decode()
    xargs = {
        "apply_steering_vectors": json.dumps([{"activations": original_vec, "layer_indices": [1], "scale": 1.5}]),
        "apply_hooks": json.dumps([{"fn": {"cloudpickle": fn}, "layer_indices": [2]}]),
        "output_residual_stream": [3],
    }
    body = {
        "model": model_name(),
        "prompt": PROMPT,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "vllm_xargs": xargs,
    }
    raw = post_json(server, "/v1/completions", body).json()
    ours = lens_client(server).generate(
        PROMPT,
        max_tokens=4,
        temperature=0,
        ignore_eos=True,
        capture_layers=[3],
        steering_vectors=[SteeringVector(v, [1], scale=1.5)],
        hooks=[Hook(_ablate, [2])],
    )
    assert raw["choices"][0]["token_ids"] == ours.token_ids
    # answered in the original's form too: the first choice's results at the top level, its tensor object
    assert "activations" not in raw["choices"][0] and raw["activations"]["residual_stream"]["compression"] == "zstd"
    assert torch.equal(decode_activations(raw)[0]["residual_stream"], ours.activations["residual_stream"])
    assert from_jsonable(raw["hook_results"]) == ours.hook_results == {"0": {"calls": 4}}


def test_results_the_original_form_cannot_carry_are_refused_not_dropped(server):
    """A request in the original's form is answered in that form (residual_stream and hook_results only):
    asking it for other results as well is a 400 naming the key, never an answer without them."""
    for key, value in (
        ("output_activations", {"attn_out": [1]}),
        ("output_sae_features", {"sae": "any", "top_k": 2}),
        ("output_probe_scores", ["any"]),
    ):
        body = {
            "model": model_name(),
            "prompt": PROMPT,
            "max_tokens": 2,
            "vllm_xargs": {"output_residual_stream": "[1]", key: json.dumps(value)},
        }
        r = post_json(server, "/v1/completions", body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == f"vllm_xargs.{key}"
        assert "original vllm-lens form" in r.json()["error"]["message"]
    # the same request in our form (a list) is served, with its results
    body["vllm_xargs"] = {"output_residual_stream": [1]}
    assert post_json(server, "/v1/completions", body).status_code == 200


def test_plain_vllm_serve_exposes_everything(locked_server, llama):
    """`locked_server` is plain `vllm serve MODEL` (nothing allow-listed): our routes and results are
    there, the same numbers as offline."""
    info = httpx.get(locked_server + "/v1/lens/info").json()
    assert (info["n_layers"], info["d_model"], info["remote_hooks"]) == (4, 128, False)
    r = LensClient(locked_server).generate(PROMPT, max_tokens=5, temperature=0, ignore_eos=True, capture_layers=[0, 3])
    want = offline(llama, PROMPT, output_residual_stream=[0, 3])
    assert r.token_ids == list(want.outputs[0].token_ids)
    assert torch.equal(r.activations["residual_stream"], want.activations["residual_stream"])
