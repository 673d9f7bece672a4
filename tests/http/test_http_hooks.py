"""Persistent and batched hooks registered over HTTP on a real `vllm-lens serve`."""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor

import httpx

from support.lens_http import PROMPT, lens_client, post_json
from support.servers import KEY
from vllm_worker import Hook


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
    c = lens_client(server)
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
    reg = post_json(server, "/v1/hooks/register", {"hooks": [{"fn": {"cloudpickle": fn}, "layer_indices": [1]}]}).json()
    assert reg["status"] == "ok" and reg["count"] == reg["registered"] == 1
    c.generate(PROMPT, max_tokens=2)
    got = post_json(server, "/v1/hooks/collect", {}).json()
    assert got["status"] == "ok" and got["count"] == 1
    assert post_json(server, "/v1/hooks/prefetch", {"names": ["lm_head.weight"]}).json()["count"] == 1
    for path in ("clear_results", "clear_prefetched", "clear"):
        assert post_json(server, f"/v1/hooks/{path}", {}).json()["status"] == "ok"


def _count_batched(ctx, h):
    for rid, s, e in ctx.rows:
        ctx.saved[rid]["rows"] = ctx.saved[rid].get("rows", 0) + e - s


def test_batched_hooks_over_http(server):
    """`Hook(batched=True)` travels as `"batched": true`: persistent (one call for every request of a step)
    and per request give each request its own rows; a non-bool `batched` is a 400 naming it."""
    c = lens_client(server)
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
        bad = post_json(server, "/v1/hooks/register", {"hooks": [{"fn": fn, "layer_indices": [1], flag: "yes"}]})
        assert bad.status_code == 400 and f"hooks[0].{flag}" in bad.text
