"""Bad requests to a real `vllm-lens serve` (bad fields, huge bodies, streams hung up on): a 4xx JSON error
naming the field, nothing left behind, and the server keeps serving."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
import torch

from support.lens_http import PROMPT, lens_client, model_name, post_json
from support.servers import KEY
from vllm_worker.protocol.wire import tensor_to_json


def _bad_cases():
    good_vec = tensor_to_json(torch.ones(1, 128))
    big = tensor_to_json(torch.ones(1, 3000, 128))  # 1.5 MB: over the 1 MiB payload limit
    huge = tensor_to_json(torch.ones(1, 8000, 128))  # 4 MB: the request body itself is refused
    return [
        ("steer JSON", {"apply_steering_vectors": "[{not json"}, 400, "apply_steering_vectors: not valid JSON"),
        (
            "steer base64",
            {"apply_steering_vectors": json.dumps([{"activations": dict(good_vec, b64="@@@"), "layer_indices": [0]}])},
            400,
            "b64",
        ),
        (
            "steer shape",
            {
                "apply_steering_vectors": json.dumps(
                    [{"activations": tensor_to_json(torch.ones(1, 64)), "layer_indices": [0]}]
                )
            },
            400,
            "d_model",
        ),
        (
            "steer dtype",
            {
                "apply_steering_vectors": json.dumps(
                    [{"activations": dict(good_vec, dtype="complex7"), "layer_indices": [0]}]
                )
            },
            400,
            "dtype",
        ),
        (
            "steer nan",
            {
                "apply_steering_vectors": json.dumps(
                    [{"activations": tensor_to_json(torch.full((1, 128), float("nan"))), "layer_indices": [0]}]
                )
            },
            400,
            "NaN",
        ),
        ("layer", {"output_residual_stream": [42]}, 400, "output_residual_stream: layer 42"),
        ("unknown key", {"output_residual_streams": [0]}, 400, "unknown inspect-lens key"),
        (
            "payload too big",
            {"apply_steering_vectors": json.dumps([{"activations": big, "layer_indices": [0]}])},
            400,
            "apply_steering_vectors: payload exceeds the limit",
        ),
        (
            "body too big",
            {"apply_steering_vectors": json.dumps([{"activations": huge, "layer_indices": [0]}])},
            413,
            "request body exceeds the limit",
        ),
        ("hook base64", {"apply_hooks": json.dumps([{"fn": "%%%", "layer_indices": [0]}])}, 400, "not valid base64"),
        # a payload the server cannot unpickle is refused before the engine sees it (it used to kill it)
        (
            "hook garbage pickle",
            {"apply_hooks": json.dumps([{"fn": base64.b64encode(b"\x80\x05garbage").decode(), "layer_indices": [0]}])},
            400,
            "cannot be loaded",
        ),
        # JSON booleans are not layers (vLLM would turn them into 0 / 1)
        ("capture bools", {"output_residual_stream": [True, False]}, 400, "layer indices must be ints"),
        ("capture false", {"output_residual_stream": False}, 400, "output_residual_stream"),
        ("capture huge layer", {"output_residual_stream": [2**70]}, 400, "output_residual_stream: layer"),
        (
            "steer scale overflow",
            {
                "apply_steering_vectors": '[{"activations": '
                + json.dumps(good_vec)
                + ', "layer_indices": [0], "scale": 1'
                + "0" * 400
                + "}]"
            },
            400,
            "scale",
        ),
        (
            "steer bool shape",
            {
                "apply_steering_vectors": json.dumps(
                    [{"activations": dict(good_vec, shape=[1, True, 128]), "layer_indices": [0]}]
                )
            },
            400,
            "shape",
        ),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_is_4xx_json_and_server_keeps_serving(server, case):
    _, xargs, status, text = case
    r = post_json(
        server, "/v1/completions", {"model": model_name(), "prompt": PROMPT, "max_tokens": 2, "vllm_xargs": xargs}
    )
    assert r.status_code == status, r.text
    assert text in r.json()["error"]["message"]
    ok = lens_client(server).generate(PROMPT, max_tokens=3, temperature=0, capture_layers=[0])
    assert len(ok.token_ids) == 3 and ok.activations["residual_stream"].shape[1] == len(ok.prompt_token_ids) + 2


def test_request_level_bad_input_names_the_field(server):
    body = {"model": model_name(), "prompt": PROMPT, "max_tokens": 2, "vllm_xargs": {"output_residual_stream": [0]}}
    r = post_json(server, "/v1/completions", dict(body, n="abc"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    r = post_json(server, "/v1/completions", dict(body, use_beam_search=True, n=2))
    assert r.status_code == 400 and "beam search" in r.json()["error"]["message"], r.text
    r = post_json(server, "/v1/hooks/prefetch", {"names": ["no.such.weight"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "names", r.text


def test_disconnected_streams_leave_nothing_behind(server):
    """Clients that hang up mid-generation: their pending entries and worker stores are released at once
    (counts in /v1/lens/info return to 0) and the server keeps serving."""
    import time

    body = {
        "model": model_name(),
        "prompt": PROMPT,
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
        "vllm_xargs": {"output_residual_stream": [0, 1, 2, 3]},
    }
    for _ in range(5):
        with httpx.stream(
            "POST", server + "/v1/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {KEY}"}
        ) as r:
            assert r.status_code == 200
            for i, _line in enumerate(r.iter_lines()):
                if i >= 3:
                    break  # hang up after a few tokens
    deadline = time.time() + 30
    while time.time() < deadline:
        info = lens_client(server).info()
        if info["pending_results"] == 0 and info["stored_requests"] == 0 and info["result_regions"] == 0:
            break
        time.sleep(0.5)
    assert (info["pending_results"], info["stored_requests"], info["result_regions"]) == (0, 0, 0), info
    ok = lens_client(server).generate(PROMPT, max_tokens=3, temperature=0, capture_layers=[0])
    assert ok.activations["residual_stream"].shape[1] == len(ok.prompt_token_ids) + 2


def test_huge_bodies_are_refused_while_they_arrive(server):
    """A 200 MB body (no Content-Length: chunked) to a generation route and to /v1/hooks/register gets a
    413 JSON error, and the server never holds it: its memory grows by far less than the body."""
    from support.servers import server_pid

    def rss_mb() -> float:
        with open(f"/proc/{server_pid(server)}/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

    def chunks():
        block = b" " * (1 << 20)
        for _ in range(200):
            yield block

    before = rss_mb()
    for path in ("/v1/completions", "/v1/hooks/register"):
        try:
            r = httpx.post(
                server + path,
                content=chunks(),
                timeout=120,
                headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"},
            )
            assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]
        except (httpx.RemoteProtocolError, httpx.WriteError):
            pass  # the server answered and closed before the client finished sending: also refused
    assert rss_mb() - before < 60
    declared = httpx.post(
        server + "/v1/completions",
        content=b"x" * (3 << 20),
        timeout=60,
        headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"},
    )
    assert declared.status_code == 413
    assert lens_client(server).generate(PROMPT, max_tokens=2, capture_layers=[0]).activations is not None
