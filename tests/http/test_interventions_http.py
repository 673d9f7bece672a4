"""Interventions beyond addition over HTTP: the JSON form (`model_dump`, `LensClient`) steers exactly like
the object offline; bad combinations are HTTP 400 naming the field and the server keeps serving."""

from __future__ import annotations

import json

import pytest
import torch

from support.lens_http import PROMPT, lens_client, model_name, offline, post_json
from vllm_worker import SteeringVector
from vllm_worker.protocol.wire import tensor_to_json


def _dir(seed: int) -> torch.Tensor:
    return torch.randn(1, 128, generator=torch.Generator().manual_seed(seed))


def test_ops_round_trip_over_http(server, llama):
    """ablate (prompt), cap (generated) and a 3-D set, by `LensClient` and as raw `model_dump()` JSON:
    tokens and captures equal offline."""
    svs = [
        SteeringVector(_dir(1), [1], op="ablate", phase="prompt"),
        SteeringVector(_dir(2), [2], op="cap", lo=-0.2, hi=0.2, phase="generated"),
        SteeringVector(_dir(3)[None].expand(1, 2, 128).clone() * 4, [1], op="set", position_indices=[0, 2]),
    ]
    want = offline(llama, PROMPT, apply_steering_vectors=svs, output_residual_stream=[1, 2, 3])
    plain = offline(llama, PROMPT, output_residual_stream=[1, 2, 3])
    assert not torch.equal(want.activations["residual_stream"], plain.activations["residual_stream"])
    got = lens_client(server).generate(
        PROMPT, max_tokens=5, temperature=0, ignore_eos=True, steering_vectors=svs, capture_layers=[1, 2, 3]
    )
    assert got.token_ids == list(want.outputs[0].token_ids)
    assert torch.equal(got.activations["residual_stream"], want.activations["residual_stream"])
    body = {
        "model": model_name(),
        "prompt": PROMPT,
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "vllm_xargs": {"apply_steering_vectors": json.dumps([sv.model_dump() for sv in svs])},
    }
    raw = post_json(server, "/v1/completions", body)
    assert raw.status_code == 200, raw.text
    assert raw.json()["choices"][0]["token_ids"] == list(want.outputs[0].token_ids)


@pytest.mark.parametrize(
    "fields,name",
    [
        ({"op": "cap", "lo": 1.0, "hi": 0.0}, "lo"),
        ({"op": "cap"}, "lo"),
        ({"op": "ablate", "activations": tensor_to_json(torch.zeros(1, 128))}, "activations"),
        ({"op": "set", "norm_match": True}, "norm_match"),
        ({"op": "swap"}, "op"),
        ({"phase": "generated", "activations": tensor_to_json(torch.ones(1, 2, 128))}, "phase"),
        (
            {"op": "set", "activations": tensor_to_json(torch.ones(1, 1, 128)), "position_indices": [500]},
            "position_indices",
        ),
    ],
)
def test_bad_ops_are_400_naming_the_field(server, fields, name):
    entry = {"activations": tensor_to_json(torch.ones(1, 128)), "layer_indices": [1], **fields}
    body = {
        "model": model_name(),
        "prompt": PROMPT,
        "max_tokens": 2,
        "vllm_xargs": {"apply_steering_vectors": json.dumps([entry])},
    }
    r = post_json(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert f"apply_steering_vectors[0].{name}" in r.json()["error"]["message"]
    ok = lens_client(server).generate(PROMPT, max_tokens=2, temperature=0)
    assert len(ok.token_ids) == 2
