"""Named vectors over HTTP: `/v1/lens/vectors` register / list / delete, steering entries naming a vector
steer exactly like the tensor inline, bad input is a 4xx naming the field, and each API key has its own."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from support.engines import model_path
from support.servers import KEY, OTHER_KEY
from vllm_worker import SteeringVector
from vllm_worker.api.client import LensBadRequest, LensClient
from vllm_worker.protocol.wire import tensor_to_json

PROMPT = "the water of people will come down to the side"


def _steered(client, vectors):
    return client.generate(
        PROMPT, max_tokens=6, temperature=0, ignore_eos=True, capture_layers=[2, 3], steering_vectors=vectors
    )


def test_steering_by_name_equals_inline_and_the_registry_is_listed_and_deleted(server):
    c = LensClient(server, api_key=KEY)
    v = torch.randn(128, generator=torch.Generator().manual_seed(11)) * 3
    assert c.register_vector("http-push", v) == {
        "status": "ok",
        "name": "http-push",
        "shape": [128],
        "dtype": "float32",
        "bytes": 512,
    }
    named = _steered(c, [SteeringVector(name="http-push", layer_indices=[1, 2], scale=2.0)])
    inline = _steered(c, [SteeringVector(v.expand(2, 128), [1, 2], scale=2.0)])
    plain = _steered(c, None)
    assert named.token_ids == inline.token_ids
    assert torch.equal(named.activations["residual_stream"], inline.activations["residual_stream"])
    assert not torch.equal(named.activations["residual_stream"], plain.activations["residual_stream"])
    assert {"name": "http-push", "shape": [128], "dtype": "float32", "bytes": 512} in c.list_vectors()

    # another key sees none of it and cannot steer with it
    other = LensClient(server, api_key=OTHER_KEY)
    assert all(x["name"] != "http-push" for x in other.list_vectors())
    with pytest.raises(LensBadRequest, match=r"apply_steering_vectors\[0\]\.name: unknown vector 'http-push'"):
        _steered(other, [SteeringVector(name="http-push", layer_indices=[1])])

    c.delete_vector("http-push")
    assert all(x["name"] != "http-push" for x in c.list_vectors())
    with pytest.raises(LensBadRequest, match=r"apply_steering_vectors\[0\]\.name: unknown vector 'http-push'"):
        _steered(c, [SteeringVector(name="http-push", layer_indices=[1])])
    with pytest.raises(LensBadRequest, match="no vector named 'http-push'") as e:
        c.delete_vector("http-push")
    assert e.value.status == 404 and e.value.param == "name"


@pytest.mark.parametrize(
    "body, param, text",
    [
        ({"name": "w", "activations": tensor_to_json(torch.ones(100))}, "activations", "last dimension 100"),
        ({"name": "nan", "activations": tensor_to_json(torch.full((128,), float("nan")))}, "activations", "NaN"),
        ({"name": "i", "activations": tensor_to_json(torch.ones(128, dtype=torch.int32))}, "activations", "float"),
        ({"name": "a/b", "activations": tensor_to_json(torch.ones(128))}, "name", "letters, digits"),
        ({"name": "x", "activations": [1.0, 2.0]}, "activations", "tensor object"),
        ({"name": "x", "activation": tensor_to_json(torch.ones(128))}, "activation", "unknown fields"),
        ({"name": "big", "activations": tensor_to_json(torch.ones(1, 2100, 128))}, "activations", "exceeds"),
    ],
    ids=["width", "nan", "int", "name", "not-a-tensor", "typo", "over-payload-limit"],
)
def test_bad_vectors_are_400_naming_the_field(server, body, param, text):
    r = httpx.post(f"{server}/v1/lens/vectors", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param) and text in r.json()["error"]["message"], r.text
    assert httpx.get(f"{server}/v1/lens/vectors").status_code == 401  # the routes sit behind the API key


def test_a_name_and_a_tensor_together_are_refused(server):
    LensClient(server, api_key=KEY).register_vector("both", torch.ones(128))
    entry = {"name": "both", "layer_indices": [0], "activations": tensor_to_json(torch.ones(1, 128))}
    xargs = {"apply_steering_vectors": json.dumps([entry])}
    body = {"model": str(model_path("llama")), "prompt": PROMPT, "max_tokens": 2, "vllm_xargs": xargs}
    r = httpx.post(f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400 and "not both" in r.json()["error"]["message"], r.text
