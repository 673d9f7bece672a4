"""A real `vllm-lens serve` on 127.0.0.1 (random free port), driven over HTTP and by `LensClient`."""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from vllm import SamplingParams

from support.engines import model_path
from support.servers import KEY
from vllm_worker import Hook, SteeringVector
from vllm_worker.api.client import LensClient, LensForbidden, LensUnauthorized
from vllm_worker.protocol.wire import from_jsonable, tensor_to_json

PROMPT = "the water of people will come down to the side"


def _client(url, key=KEY):
    return LensClient(url, api_key=key)


def _model() -> str:
    return str(model_path("llama"))


def _offline(llama, prompt_or_messages, n=1, **extra):
    sp = SamplingParams(max_tokens=5, temperature=0 if n == 1 else 1.0, seed=3, n=n, ignore_eos=True, extra_args=extra)
    if isinstance(prompt_or_messages, list):
        return llama.chat(prompt_or_messages, sp, use_tqdm=False)[0]
    return llama.generate([prompt_or_messages], sp, use_tqdm=False)[0]


def _sse(url: str, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
            elif line == "data: [DONE]":
                events.append("DONE")
    return events


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_http_capture_equals_offline(server, llama, chat):
    c = _client(server)
    messages = [{"role": "user", "content": "the people will come"}]
    src = messages if chat else PROMPT
    for n in (1, 2):
        kw = dict(messages=messages) if chat else dict(prompt=PROMPT)
        r = c.generate(
            **kw, max_tokens=5, capture_layers=[0, 3], n=n, temperature=0 if n == 1 else 1.0, seed=3, ignore_eos=True
        )
        ref = _offline(llama, src, n=n, output_residual_stream=[0, 3])
        assert len(r.choices) == n
        for got, want in zip(r.choices, ref.outputs):
            assert got.token_ids == list(want.token_ids)
            assert torch.equal(got.activations["residual_stream"], want.activations["residual_stream"])
    # streaming: the activations arrive in one extra chunk before [DONE]
    body = {
        "model": _model(),
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "vllm_xargs": {"output_residual_stream": [0, 3]},
    }
    body.update({"messages": messages} if chat else {"prompt": PROMPT})
    events = _sse(server, "/v1/chat/completions" if chat else "/v1/completions", body)
    assert events[-1] == "DONE" and "activations" in events[-2]["choices"][0]
    from vllm_worker.protocol.wire import tensor_from_json

    got = tensor_from_json(events[-2]["choices"][0]["activations"]["residual_stream"])
    assert torch.equal(got, _offline(llama, src, output_residual_stream=[0, 3]).activations["residual_stream"])


def _ablate(ctx, h):
    h = h.clone()
    h[:, 0] = 0
    ctx.saved["calls"] = ctx.saved.get("calls", 0) + 1
    return h


def test_16_concurrent_mixed_requests_equal_each_alone(server):
    c = _client(server)
    v = torch.randn(1, 128, generator=torch.Generator().manual_seed(2)) * 4
    kinds = [
        {},
        {"capture_layers": [1]},
        {"steering_vectors": [SteeringVector(v, [1])], "capture_layers": [2]},
        {"hooks": [Hook(_ablate, [2])], "capture_layers": [3]},
    ]
    jobs = [
        (f"{PROMPT} {w}", kinds[i % 4])
        for i, w in enumerate("the a of to and in is it that was for on are with as his".split())
    ]

    def run(job):
        prompt, kw = job
        return c.generate(prompt, max_tokens=4, temperature=0, ignore_eos=True, **kw)

    alone = [run(j) for j in jobs]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, jobs))
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        if a.activations is not None:
            assert (a.activations["residual_stream"] - b.activations["residual_stream"]).abs().max() <= 1e-5
        assert a.hook_results == b.hook_results
    assert alone[3].hook_results["0"]["calls"] == 4
    assert alone[3].activations["residual_stream"][0, :, 0].abs().max() > 0  # layer 3 recomputes dim 0


def test_hooks_need_opt_in_and_api_key(server, locked_server):
    with pytest.raises(LensForbidden, match="allow-remote-hooks"):
        LensClient(locked_server).generate(PROMPT, max_tokens=2, hooks=[Hook(_ablate, [0])])
    with pytest.raises(LensForbidden):
        LensClient(locked_server).register_hooks([Hook(_ablate, [0])])
    assert LensClient(locked_server).generate(PROMPT, max_tokens=2, capture_layers=[0]).activations is not None
    r = _client(server).generate(PROMPT, max_tokens=2, hooks=[Hook(_ablate, [0])])
    assert r.hook_results["0"]["calls"] == 2
    for path in ("register", "collect", "clear", "clear_results", "prefetch", "clear_prefetched"):
        assert httpx.post(f"{server}/v1/hooks/{path}", json={}).status_code == 401
    with pytest.raises(LensUnauthorized):
        LensClient(server, api_key="wrong").collect_hook_results()


def _post(url, path, body, key=KEY):
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300)


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
    r = _post(server, "/v1/completions", {"model": _model(), "prompt": PROMPT, "max_tokens": 2, "vllm_xargs": xargs})
    assert r.status_code == status, r.text
    assert text in r.json()["error"]["message"]
    ok = _client(server).generate(PROMPT, max_tokens=3, temperature=0, capture_layers=[0])
    assert len(ok.token_ids) == 3 and ok.activations["residual_stream"].shape[1] == len(ok.prompt_token_ids) + 2


def test_request_level_bad_input_names_the_field(server):
    body = {"model": _model(), "prompt": PROMPT, "max_tokens": 2, "vllm_xargs": {"output_residual_stream": [0]}}
    r = _post(server, "/v1/completions", dict(body, n="abc"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    r = _post(server, "/v1/completions", dict(body, use_beam_search=True, n=2))
    assert r.status_code == 400 and "beam search" in r.json()["error"]["message"], r.text
    r = _post(server, "/v1/hooks/prefetch", {"names": ["no.such.weight"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "names", r.text


def test_capture_true_means_every_layer_over_http_and_offline(server, llama):
    """The original tool's form: `output_residual_stream: true` = all layers (vLLM would make it layer 1)."""
    r = _post(
        server,
        "/v1/completions",
        {
            "model": _model(),
            "prompt": PROMPT,
            "max_tokens": 3,
            "temperature": 0,
            "vllm_xargs": {"output_residual_stream": True},
        },
    )
    assert r.status_code == 200, r.text
    got = from_jsonable(r.json()["choices"][0]["activations"]["residual_stream"])
    assert r.json()["choices"][0]["activations"]["layers"] == [0, 1, 2, 3]
    sp = lambda v: SamplingParams(max_tokens=3, temperature=0, extra_args={"output_residual_stream": v})  # noqa: E731
    for form in (True, "all", "[0, 1, 2, 3]", [0, 1, 2, 3]):
        off = llama.generate([PROMPT], sp(form), use_tqdm=False)[0]
        assert off.activations["layers"] == [0, 1, 2, 3]
        assert torch.equal(off.activations["residual_stream"], got), form


def test_hooks_without_opt_in_is_403_and_server_keeps_serving(locked_server):
    fn = base64.b64encode(b"not even a pickle").decode()
    r = _post(
        locked_server,
        "/v1/completions",
        {
            "model": _model(),
            "prompt": PROMPT,
            "max_tokens": 2,
            "vllm_xargs": {"apply_hooks": json.dumps([{"fn": fn, "layer_indices": [0]}])},
        },
    )
    assert r.status_code == 403 and r.json()["error"]["param"] == "vllm_xargs.apply_hooks"
    assert len(LensClient(locked_server).generate(PROMPT, max_tokens=3).token_ids) == 3


def _count(ctx, h):
    ctx.saved["rows"] = ctx.saved.get("rows", 0) + ctx.seq_len


BAD_BODIES = (b"not json", b"[1, 2]", json.dumps({"model": "m", "prompt": "p", "n": "many"}).encode())


def _raw_post(url: str, raw: bytes) -> tuple[int, str]:
    r = httpx.post(
        url + "/v1/completions",
        content=raw,
        headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"},
    )
    return r.status_code, r.json()["error"]["message"]


def test_persistent_hooks_over_http(server):
    c = _client(server)
    c.clear_hooks()
    plain = [_raw_post(server, raw) for raw in BAD_BODIES]
    assert all(status == 400 for status, _ in plain), plain
    assert c.register_hooks([Hook(_count, [1])], prefetch_params=["lm_head.weight"]) == 1
    # with persistent hooks on, every generation request passes through our middleware: a body that is not a
    # JSON object, or an `n` vLLM refuses, still gets vLLM's own 400, the same as with no hooks registered
    assert [_raw_post(server, raw) for raw in BAD_BODIES] == plain
    assert c.prefetch_params(["model.norm.weight"]) == ["lm_head.weight", "model.norm.weight"]
    c.clear_prefetched()
    prompts = [f"{PROMPT} {w}" for w in "the a of to and in is it that was".split()]
    with ThreadPoolExecutor(5) as pool:
        outs = list(pool.map(lambda p: c.generate(p, max_tokens=3, ignore_eos=True), prompts))
    res = c.collect_hook_results()
    assert len(res) == 10
    assert sorted(r["0"]["rows"] for r in res.values()) == sorted(len(o.prompt_token_ids) + 2 for o in outs)
    c.clear_hook_results()
    assert c.collect_hook_results() == {}
    c.clear_hooks()
    # the replies also carry the original's {"status": "ok", "count": ...}
    fn = base64.b64encode(__import__("cloudpickle").dumps(_count)).decode()
    reg = _post(server, "/v1/hooks/register", {"hooks": [{"fn": {"cloudpickle": fn}, "layer_indices": [1]}]}).json()
    assert reg["status"] == "ok" and reg["count"] == reg["registered"] == 1
    c.generate(PROMPT, max_tokens=2)
    got = _post(server, "/v1/hooks/collect", {}).json()
    assert got["status"] == "ok" and got["count"] == 1
    assert _post(server, "/v1/hooks/prefetch", {"names": ["lm_head.weight"]}).json()["count"] == 1
    for path in ("clear_results", "clear_prefetched", "clear"):
        assert _post(server, f"/v1/hooks/{path}", {}).json()["status"] == "ok"


def _count_batched(ctx, h):
    for rid, s, e in ctx.rows:
        ctx.saved[rid]["rows"] = ctx.saved[rid].get("rows", 0) + e - s


def test_batched_hooks_over_http(server):
    """`Hook(batched=True)` travels as `"batched": true`: persistent (one call for every request of a step)
    and per request give each request its own rows; a non-bool `batched` is a 400 naming it."""
    c = _client(server)
    c.clear_hooks()
    c.register_hooks([Hook(_count_batched, [1], batched=True)])
    try:
        prompts = [f"{PROMPT} {w}" for w in "the a of to".split()]
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda p: c.generate(p, max_tokens=3, ignore_eos=True), prompts))
        res = c.collect_hook_results()
    finally:
        c.clear_hooks()
    assert sorted(r["0"]["rows"] for r in res.values()) == sorted(len(o.prompt_token_ids) + 2 for o in outs)
    for read_only in (False, True):  # read-only hooks (run after the forward) travel as "read_only": true
        hook = Hook(_count_batched, [1], batched=True, read_only=read_only)
        one = c.generate(PROMPT, max_tokens=2, ignore_eos=True, hooks=[hook])
        assert one.hook_results["0"]["rows"] == len(one.prompt_token_ids) + 1
    fn = base64.b64encode(__import__("cloudpickle").dumps(_count_batched)).decode()
    for flag in ("batched", "read_only"):
        bad = _post(server, "/v1/hooks/register", {"hooks": [{"fn": fn, "layer_indices": [1], flag: "yes"}]})
        assert bad.status_code == 400 and f"hooks[0].{flag}" in bad.text


def test_async_client_equals_sync_client(server):
    import asyncio

    from vllm_worker.api.client import AsyncLensClient

    async def run():
        c = AsyncLensClient(server, api_key=KEY)
        try:
            return await asyncio.gather(
                *[c.generate(PROMPT, max_tokens=3, temperature=0, capture_layers=[2]) for _ in range(3)]
            )
        finally:
            await c.aclose()

    sync = _client(server).generate(PROMPT, max_tokens=3, temperature=0, capture_layers=[2])
    for r in asyncio.run(run()):
        assert r.token_ids == sync.token_ids
        assert torch.equal(r.activations["residual_stream"], sync.activations["residual_stream"])


def test_inspect_provider_capture_and_steering_equal_offline(server, llama):
    """`vllm-lens/<model>` through Inspect's model API: metadata holds the same tensors as offline."""
    import asyncio

    from inspect_ai.model import ChatMessageUser, GenerateConfig, get_model

    messages = [{"role": "user", "content": "the people will come"}]
    v = torch.randn(1, 128, generator=torch.Generator().manual_seed(4)) * 6
    model = get_model(f"vllm-lens/{_model()}", base_url=f"{server}/v1", api_key=KEY)

    async def run(extra):
        return await model.generate(
            [ChatMessageUser(content=messages[0]["content"])],
            config=GenerateConfig(max_tokens=5, temperature=0, extra_body={"extra_args": extra}),
        )

    capture = asyncio.run(run({"output_residual_stream": [0, 3]}))
    ref = _offline(llama, messages, output_residual_stream=[0, 3])
    acts = capture.metadata["activations"]
    assert acts["layers"] == [0, 3] and torch.equal(acts["residual_stream"], ref.activations["residual_stream"])
    assert capture.metadata["token_ids"] == list(ref.outputs[0].token_ids)

    steered = asyncio.run(run({"apply_steering_vectors": [SteeringVector(v, [1])], "output_residual_stream": [2]}))
    ref_steered = _offline(llama, messages, apply_steering_vectors=[SteeringVector(v, [1])], output_residual_stream=[2])
    assert steered.metadata["token_ids"] == list(ref_steered.outputs[0].token_ids)
    assert steered.metadata["token_ids"] != capture.metadata["token_ids"]
    assert torch.equal(steered.metadata["activations"]["residual_stream"], ref_steered.activations["residual_stream"])


def test_inspect_eval_log_stays_small_and_loads(server, tmp_path):
    from inspect_ai import Task
    from inspect_ai import eval as inspect_eval
    from inspect_ai.dataset import Sample
    from inspect_ai.log import read_eval_log
    from inspect_ai.model import GenerateConfig
    from inspect_ai.solver import generate

    task = Task(
        dataset=[Sample(input="the people will come"), Sample(input="a long thing")],
        solver=generate(),
        config=GenerateConfig(
            max_tokens=8, temperature=0, extra_body={"extra_args": {"output_residual_stream": [0, 1, 2, 3]}}
        ),
    )
    [log] = inspect_eval(
        task,
        model=f"vllm-lens/{_model()}",
        model_base_url=f"{server}/v1",
        model_args={"api_key": KEY},
        log_dir=str(tmp_path),
        display="none",
    )
    assert log.status == "success", log.error
    path = Path(log.location)
    captured_bytes = 2 * 4 * 20 * 128 * 4  # two samples, 4 layers, ~20 positions, d=128, float32
    assert path.stat().st_size < captured_bytes / 2, path.stat().st_size
    back = read_eval_log(str(path))
    assert len(back.samples) == 2
    calls = [e.call for s in back.samples for e in s.events if getattr(e, "call", None) is not None]
    text = json.dumps([c.response for c in calls])
    assert '"b64"' not in text and '"tensor": true' in text


def test_lens_info_reports_the_served_model_shape(server):
    info = _client(server).info()
    assert (info["n_layers"], info["d_model"]) == (4, 128) and info["remote_hooks"] is True
    assert httpx.get(server + "/v1/lens/info").status_code == 401  # --api-key guards it like the rest


def test_disconnected_streams_leave_nothing_behind(server):
    """Clients that hang up mid-generation: their pending entries and worker stores are released at once
    (counts in /v1/lens/info return to 0) and the server keeps serving."""
    import time

    body = {
        "model": _model(),
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
        info = _client(server).info()
        if info["pending_results"] == 0 and info["stored_requests"] == 0 and info["result_regions"] == 0:
            break
        time.sleep(0.5)
    assert (info["pending_results"], info["stored_requests"], info["result_regions"]) == (0, 0, 0), info
    ok = _client(server).generate(PROMPT, max_tokens=3, temperature=0, capture_layers=[0])
    assert ok.activations["residual_stream"].shape[1] == len(ok.prompt_token_ids) + 2


def test_client_shapes_of_the_original(server, llama):
    """`VLLMLensClient` (the original's name) with `.chat()`, the model found through /v1/models, logprobs
    when asked, and `decode_activations` on a raw JSON response: same numbers as offline."""
    from vllm_worker import VLLMLensClient, decode_activations

    c = VLLMLensClient(server, api_key=KEY)  # no model given: read from /v1/models
    messages = [{"role": "user", "content": "the people will come"}]
    r = c.chat(
        messages, max_tokens=5, temperature=0, ignore_eos=True, capture_layers=[1], logprobs=True, top_logprobs=2
    )
    assert c.model == _model()
    ref = _offline(llama, messages, output_residual_stream=[1])
    assert r.token_ids == list(ref.outputs[0].token_ids)
    assert torch.equal(r.activations["residual_stream"], ref.activations["residual_stream"])
    assert len(r.logprobs["content"]) == 5 and len(r.logprobs["content"][0]["top_logprobs"]) == 2
    raw = httpx.post(
        server + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
        json={
            "model": _model(),
            "prompt": PROMPT,
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 1,
            "vllm_xargs": {"output_residual_stream": [0, 3]},
        },
    ).json()
    acts = decode_activations(raw)
    want = _offline(llama, PROMPT, output_residual_stream=[0, 3])
    assert acts[0]["layers"] == [0, 3] and torch.equal(acts[0]["residual_stream"], want.activations["residual_stream"])
    assert c.generate(PROMPT, max_tokens=3, logprobs=1).logprobs["token_logprobs"][0] <= 0


def test_model_dump_of_a_steering_vector_is_an_accepted_wire_form(server, llama):
    """`SteeringVector.model_dump()` is JSON: sent as is in `vllm_xargs` it steers exactly like the
    object offline."""
    from vllm_worker import SteeringVector

    sv = SteeringVector(torch.randn(1, 128, generator=torch.Generator().manual_seed(4)) * 5, [1], scale=1.5)
    body = {
        "model": _model(),
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

    want = _offline(llama, PROMPT, apply_steering_vectors=[sv], output_residual_stream=[2])
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
        "model": _model(),
        "prompt": PROMPT,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "vllm_xargs": xargs,
    }
    raw = _post(server, "/v1/completions", body).json()
    ours = _client(server).generate(
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


def test_plain_vllm_serve_exposes_everything(locked_server, llama):
    """`locked_server` is plain `vllm serve MODEL` (nothing allow-listed): our routes and results are
    there, the same numbers as offline."""
    info = httpx.get(locked_server + "/v1/lens/info").json()
    assert (info["n_layers"], info["d_model"], info["remote_hooks"]) == (4, 128, False)
    r = LensClient(locked_server).generate(PROMPT, max_tokens=5, temperature=0, ignore_eos=True, capture_layers=[0, 3])
    want = _offline(llama, PROMPT, output_residual_stream=[0, 3])
    assert r.token_ids == list(want.outputs[0].token_ids)
    assert torch.equal(r.activations["residual_stream"], want.activations["residual_stream"])


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
    assert _client(server).generate(PROMPT, max_tokens=2, capture_layers=[0]).activations is not None


def test_hook_points_over_http_client_and_inspect_equal_offline(server, llama):
    """`output_activations` and `point=` over raw JSON (an object or its string), `LensClient(capture=)`
    and Inspect's metadata: the same tensors as offline; a bad point is a 400 naming the field."""
    import asyncio

    from inspect_ai.model import GenerateConfig, get_model

    want = {"attn_out": [1, 3], "resid_mid": [2], "mlp_out": [0]}
    v = torch.randn(1, 128, generator=torch.Generator().manual_seed(8)) * 3
    sv = SteeringVector(v, [1], point="mlp_out", norm_match=True)
    ref = _offline(llama, PROMPT, output_activations=want, apply_steering_vectors=[sv])
    for form in (want, json.dumps(want)):
        body = {"model": _model(), "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        body["vllm_xargs"] = {"output_activations": form, "apply_steering_vectors": json.dumps([sv.model_dump()])}
        r = _post(server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        acts = r.json()["choices"][0]["activations"]
        assert acts["points"] == want and "residual_stream" not in acts
        for p in want:
            assert torch.equal(from_jsonable(acts[p]), ref.activations[p]), p
    got = _client(server).generate(
        PROMPT, max_tokens=5, temperature=0, ignore_eos=True, capture=want, steering_vectors=[sv]
    )
    for p in want:
        assert torch.equal(got.activations[p], ref.activations[p]), p
    model = get_model(f"vllm-lens/{_model()}", base_url=f"{server}/v1", api_key=KEY)
    out = asyncio.run(
        model.generate(
            PROMPT,
            config=GenerateConfig(
                max_tokens=3, temperature=0, extra_body={"extra_args": {"output_activations": {"mlp_out": [2]}}}
            ),
        )
    )
    assert out.metadata["activations"]["points"] == {"mlp_out": [2]}
    assert out.metadata["activations"]["mlp_out"].shape[0] == 1
    bad = {"model": _model(), "prompt": PROMPT, "max_tokens": 2, "vllm_xargs": {"output_activations": {"attn": [1]}}}
    r = _post(server, "/v1/completions", bad)
    assert r.status_code == 400 and "did you mean 'attn_out'" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "vllm_xargs.output_activations.attn"
    info = httpx.get(server + "/v1/lens/info", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert info["points"] == ["resid_pre", "q", "k", "z", "attn_out", "resid_mid", "mlp_out", "resid_post"]
    assert list(info["missing_points"]) == ["router_logits"]  # a dense model
