"""A real `vllm-lens serve` on 127.0.0.1 (random free port), driven over HTTP, by `LensClient` and by
Inspect: its numbers equal the offline engine's."""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from vllm import SamplingParams

from support.lens_http import PROMPT, lens_client, model_name, offline, post_json, sse_events
from support.servers import KEY
from vllm_worker import Hook, SteeringVector
from vllm_worker.api.client import LensClient, LensForbidden, LensUnauthorized
from vllm_worker.protocol.wire import from_jsonable


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_http_capture_equals_offline(server, llama, chat):
    c = lens_client(server)
    messages = [{"role": "user", "content": "the people will come"}]
    src = messages if chat else PROMPT
    for n in (1, 2):
        kw = dict(messages=messages) if chat else dict(prompt=PROMPT)
        r = c.generate(
            **kw, max_tokens=5, capture_layers=[0, 3], n=n, temperature=0 if n == 1 else 1.0, seed=3, ignore_eos=True
        )
        ref = offline(llama, src, n=n, output_residual_stream=[0, 3])
        assert len(r.choices) == n
        for got, want in zip(r.choices, ref.outputs):
            assert got.token_ids == list(want.token_ids)
            assert torch.equal(got.activations["residual_stream"], want.activations["residual_stream"])
    # streaming: the activations arrive in one extra chunk before [DONE]
    body = {
        "model": model_name(),
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "vllm_xargs": {"output_residual_stream": [0, 3]},
    }
    body.update({"messages": messages} if chat else {"prompt": PROMPT})
    events = sse_events(server, "/v1/chat/completions" if chat else "/v1/completions", body)
    assert events[-1] == "DONE" and "activations" in events[-2]["choices"][0]
    from vllm_worker.protocol.wire import tensor_from_json

    got = tensor_from_json(events[-2]["choices"][0]["activations"]["residual_stream"])
    assert torch.equal(got, offline(llama, src, output_residual_stream=[0, 3]).activations["residual_stream"])


def _ablate(ctx, h):
    h = h.clone()
    h[:, 0] = 0
    ctx.saved["calls"] = ctx.saved.get("calls", 0) + 1
    return h


def test_16_concurrent_mixed_requests_equal_each_alone(server):
    c = lens_client(server)
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
    r = lens_client(server).generate(PROMPT, max_tokens=2, hooks=[Hook(_ablate, [0])])
    assert r.hook_results["0"]["calls"] == 2
    for path in ("register", "collect", "clear", "clear_results", "prefetch", "clear_prefetched"):
        assert httpx.post(f"{server}/v1/hooks/{path}", json={}).status_code == 401
    with pytest.raises(LensUnauthorized):
        LensClient(server, api_key="wrong").collect_hook_results()


def test_capture_true_means_every_layer_over_http_and_offline(server, llama):
    """The original tool's form: `output_residual_stream: true` = all layers (vLLM would make it layer 1)."""
    r = post_json(
        server,
        "/v1/completions",
        {
            "model": model_name(),
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
    r = post_json(
        locked_server,
        "/v1/completions",
        {
            "model": model_name(),
            "prompt": PROMPT,
            "max_tokens": 2,
            "vllm_xargs": {"apply_hooks": json.dumps([{"fn": fn, "layer_indices": [0]}])},
        },
    )
    assert r.status_code == 403 and r.json()["error"]["param"] == "vllm_xargs.apply_hooks"
    assert len(LensClient(locked_server).generate(PROMPT, max_tokens=3).token_ids) == 3


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

    sync = lens_client(server).generate(PROMPT, max_tokens=3, temperature=0, capture_layers=[2])
    for r in asyncio.run(run()):
        assert r.token_ids == sync.token_ids
        assert torch.equal(r.activations["residual_stream"], sync.activations["residual_stream"])


def test_inspect_provider_capture_and_steering_equal_offline(server, llama):
    """`vllm-lens/<model>` through Inspect's model API: metadata holds the same tensors as offline."""
    import asyncio

    from inspect_ai.model import ChatMessageUser, GenerateConfig, get_model

    messages = [{"role": "user", "content": "the people will come"}]
    v = torch.randn(1, 128, generator=torch.Generator().manual_seed(4)) * 6
    model = get_model(f"vllm-lens/{model_name()}", base_url=f"{server}/v1", api_key=KEY)

    async def run(extra):
        return await model.generate(
            [ChatMessageUser(content=messages[0]["content"])],
            config=GenerateConfig(max_tokens=5, temperature=0, extra_body={"extra_args": extra}),
        )

    capture = asyncio.run(run({"output_residual_stream": [0, 3]}))
    ref = offline(llama, messages, output_residual_stream=[0, 3])
    acts = capture.metadata["activations"]
    assert acts["layers"] == [0, 3] and torch.equal(acts["residual_stream"], ref.activations["residual_stream"])
    assert capture.metadata["token_ids"] == list(ref.outputs[0].token_ids)

    steered = asyncio.run(run({"apply_steering_vectors": [SteeringVector(v, [1])], "output_residual_stream": [2]}))
    ref_steered = offline(llama, messages, apply_steering_vectors=[SteeringVector(v, [1])], output_residual_stream=[2])
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
        model=f"vllm-lens/{model_name()}",
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
    info = lens_client(server).info()
    assert (info["n_layers"], info["d_model"]) == (4, 128) and info["remote_hooks"] is True
    assert httpx.get(server + "/v1/lens/info").status_code == 401  # --api-key guards it like the rest


def test_hook_points_over_http_client_and_inspect_equal_offline(server, llama):
    """`output_activations` and `point=` over raw JSON (an object or its string), `LensClient(capture=)`
    and Inspect's metadata: the same tensors as offline; a bad point is a 400 naming the field."""
    import asyncio

    from inspect_ai.model import GenerateConfig, get_model

    want = {"attn_out": [1, 3], "resid_mid": [2], "mlp_in": [1], "mlp_post": [2, 3], "mlp_out": [0]}
    v = torch.randn(1, 128, generator=torch.Generator().manual_seed(8)) * 3
    sv = SteeringVector(v, [1], point="mlp_out", norm_match=True)
    ref = offline(llama, PROMPT, output_activations=want, apply_steering_vectors=[sv])
    for form in (want, json.dumps(want)):
        body = {"model": model_name(), "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        body["vllm_xargs"] = {"output_activations": form, "apply_steering_vectors": json.dumps([sv.model_dump()])}
        r = post_json(server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        acts = r.json()["choices"][0]["activations"]
        assert acts["points"] == want and "residual_stream" not in acts
        for p in want:
            assert torch.equal(from_jsonable(acts[p]), ref.activations[p]), p
    got = lens_client(server).generate(
        PROMPT, max_tokens=5, temperature=0, ignore_eos=True, capture=want, steering_vectors=[sv]
    )
    for p in want:
        assert torch.equal(got.activations[p], ref.activations[p]), p
    model = get_model(f"vllm-lens/{model_name()}", base_url=f"{server}/v1", api_key=KEY)
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
    bad = {
        "model": model_name(),
        "prompt": PROMPT,
        "max_tokens": 2,
        "vllm_xargs": {"output_activations": {"attn": [1]}},
    }
    r = post_json(server, "/v1/completions", bad)
    assert r.status_code == 400 and "did you mean 'attn_out'" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "vllm_xargs.output_activations.attn"
    info = httpx.get(server + "/v1/lens/info", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert info["points"] == [
        "resid_pre",
        "q",
        "k",
        "z",
        "attn_out",
        "resid_mid",
        "mlp_in",
        "mlp_post",
        "mlp_out",
        "resid_post",
    ]
    assert (info["d_model"], info["d_mlp"]) == (128, 256)
    assert list(info["missing_points"]) == ["router_logits"]  # a dense model
