"""Limits set with `vllm-lens serve --lens-max-...` flags (and their offline twins): each refusal names its
knob, before any compute."""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from support.lens_http import AUTH, PROMPT, model_name, wait_zero
from support.servers import KEY, _serve
from vllm_worker.api.client import LensBadRequest, LensClient
from vllm_worker.protocol.wire import tensor_to_json


@pytest.fixture(scope="module")
def limited_server():
    return _serve(
        "--api-key",
        KEY,
        "--allow-remote-hooks",
        "--lens-max-capture-gb",
        "0.003",
        "--lens-max-stored-gb=0.008",
        "--lens-max-payload-mb",
        "0.25",
        "--lens-max-persistent-results",
        "3",
        "--lens-max-vectors-mb",
        "0.0007",
    )


def test_limits_come_from_flags_and_each_refusal_names_its_knob(limited_server):
    url = limited_server
    info = LensClient(url, api_key=KEY).info()
    assert info["limits"] == {
        "VLLM_LENS_MAX_PAYLOAD_MB": int(0.25 * 2**20),
        "VLLM_LENS_MAX_CAPTURE_GB": int(0.003 * 2**30),
        "VLLM_LENS_MAX_STORED_GB": int(0.008 * 2**30),
        "VLLM_LENS_MAX_PERSISTENT_RESULTS": 3,
        "VLLM_LENS_MAX_VECTORS_MB": int(0.0007 * 2**20),
    }
    # named vectors: 734 bytes in all; a 512-byte vector fits, a second one does not
    c = LensClient(url, api_key=KEY)
    c.register_vector("fits", torch.ones(128))
    with pytest.raises(LensBadRequest, match="VLLM_LENS_MAX_VECTORS_MB") as e:
        c.register_vector("too-many", torch.ones(128))
    assert e.value.param == "activations" and [v["name"] for v in c.list_vectors()] == ["fits"]
    c.delete_vector("fits")
    base = {"model": model_name(), "prompt": PROMPT, "ignore_eos": True}
    # one request's capture at its largest: 4 layers x (10 + 400 - 1) positions x 128 x 4 B x n 5 = 4 MiB > 3
    r = httpx.post(
        url + "/v1/completions",
        headers=AUTH,
        timeout=60,
        json=dict(base, max_tokens=400, n=5, vllm_xargs={"output_residual_stream": [0, 1, 2, 3]}),
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "vllm_xargs.output_residual_stream" and "VLLM_LENS_MAX_CAPTURE_GB" in err["message"]
    # in flight: four ~2.5 MiB captures sent together: three fit under 8 MiB, one is refused with 503
    # before it runs (all are admitted within milliseconds; each then takes ~seconds to generate)
    big = dict(base, max_tokens=400, n=3, vllm_xargs={"output_residual_stream": [0, 1, 2, 3]})
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda _: httpx.post(url + "/v1/completions", headers=AUTH, timeout=120, json=big), range(4)))
    codes = sorted(r.status_code for r in got)
    assert codes == [200, 200, 200, 503], [r.text[:300] for r in got]
    refused = next(r for r in got if r.status_code == 503)
    assert "VLLM_LENS_MAX_STORED_GB" in refused.json()["error"]["message"]
    assert wait_zero(url) == (0, 0, 0, 0)
    ok = httpx.post(url + "/v1/completions", headers=AUTH, timeout=60, json=dict(big, max_tokens=20))
    assert ok.status_code == 200 and "activations" in ok.json()["choices"][0]
    # payload and body limits
    vec = tensor_to_json(torch.ones(1, 700, 128))  # 350 KiB > 0.25 MiB
    r = httpx.post(
        url + "/v1/completions",
        headers=AUTH,
        timeout=60,
        json=dict(
            base,
            max_tokens=2,
            vllm_xargs={"apply_steering_vectors": json.dumps([{"activations": vec, "layer_indices": [0]}])},
        ),
    )
    assert r.status_code == 400 and "VLLM_LENS_MAX_PAYLOAD_MB" in r.json()["error"]["message"], r.text
    r = httpx.post(
        url + "/v1/completions",
        headers={**AUTH, "content-type": "application/json"},
        timeout=60,
        content=b" " * (2 << 20),
    )
    assert r.status_code == 413 and "VLLM_LENS_MAX_PAYLOAD_MB" in r.json()["error"]["message"]
    # persistent-hook results: the 4th request past 3 kept results fails, naming the knob
    import cloudpickle

    def keep(ctx, h):
        ctx.saved["n"] = int(h.shape[0])

    fn = base64.b64encode(cloudpickle.dumps(keep)).decode()
    r = httpx.post(
        url + "/v1/hooks/register", headers=AUTH, timeout=60, json={"hooks": [{"fn": fn, "layer_indices": [0]}]}
    )
    assert r.status_code == 200, r.text
    try:
        codes = [
            httpx.post(url + "/v1/completions", headers=AUTH, timeout=60, json=dict(base, max_tokens=2))
            for _ in range(4)
        ]
        assert [x.status_code for x in codes[:3]] == [200, 200, 200]
        assert codes[3].status_code >= 400 and "VLLM_LENS_MAX_PERSISTENT_RESULTS" in codes[3].text, codes[3].text
    finally:
        httpx.post(url + "/v1/hooks/clear", headers=AUTH, timeout=60)


def test_limits_offline_are_value_errors_before_any_compute(llama, monkeypatch):
    from vllm import SamplingParams

    monkeypatch.setenv("VLLM_LENS_MAX_CAPTURE_GB", str(1 / 4096))  # 256 KiB < 4 x 209 x 128 x 4 B
    sp = SamplingParams(max_tokens=200, extra_args={"output_residual_stream": [0, 1, 2, 3]})
    with pytest.raises(ValueError, match="output_residual_stream.*VLLM_LENS_MAX_CAPTURE_GB"):
        llama.generate([PROMPT], sp, use_tqdm=False)
    monkeypatch.setenv("VLLM_LENS_MAX_CAPTURE_GB", "1")
    monkeypatch.setenv("VLLM_LENS_MAX_STORED_GB", str(2 / 1024))  # 2 MiB: a call of 10 such prompts is too much
    with pytest.raises(ValueError, match="VLLM_LENS_MAX_STORED_GB"):
        llama.generate([PROMPT] * 10, sp, use_tqdm=False)
    monkeypatch.delenv("VLLM_LENS_MAX_STORED_GB")
    out = llama.generate(
        [PROMPT] * 10, SamplingParams(max_tokens=3, extra_args={"output_residual_stream": [0]}), use_tqdm=False
    )
    assert all(o.activations["residual_stream"].shape[0] == 1 for o in out)
    from vllm_worker import compat
    from vllm_worker.frontend.requests import in_flight_bytes, pending_count

    proc = compat.processor_of_llm(llama)
    assert pending_count(proc) == 0 and in_flight_bytes(proc) == 0
