"""Every way of driving vLLM hands results back on its own outputs: `LLM.generate` (elsewhere),
`LLMEngine.add_request` + `step()`, and `AsyncLLM.generate` (= AsyncLLMEngine; streamed or not). Shapes
and numbers equal `LLM.generate`'s; an engine whose outputs nobody reads (vLLM's own OpenAI server
without our HTTP plugin) still refuses capture instead of dropping it."""

from __future__ import annotations

import asyncio

import pytest
import torch
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from support.engines import ENGINE_DEFAULTS, keep_alive, model_path
from vllm_worker import Hook, SteeringVector

PROMPT = "the water of people will come down to the side"


def _count(ctx, h):
    ctx.saved["rows"] = ctx.saved.get("rows", 0) + h.shape[0]


def _params(**kw) -> SamplingParams:
    v = torch.randn(1, 128, generator=torch.Generator().manual_seed(2)) * 4
    extra = {
        "output_residual_stream": [0, 3],
        "apply_steering_vectors": [SteeringVector(v, [1])],
        "apply_hooks": [Hook(_count, [2])],
    }
    opts = dict(max_tokens=5, temperature=0, ignore_eos=True, extra_args=extra)
    opts.update(kw)
    return SamplingParams(**opts)


def _same(out, ref) -> None:
    assert len(out.outputs) == len(ref.outputs)
    for c, r in zip(out.outputs, ref.outputs):
        assert list(c.token_ids) == list(r.token_ids)
        assert torch.equal(c.activations["residual_stream"], r.activations["residual_stream"])
        assert c.activations["layers"] == [0, 3] and c.hook_results == r.hook_results
    assert torch.equal(out.activations["residual_stream"], ref.activations["residual_stream"])


def test_llm_engine_step_loop_gets_results_on_its_outputs(llama):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    engine = keep_alive(LLMEngine.from_engine_args(EngineArgs(model=str(model_path("llama")), **ENGINE_DEFAULTS)))
    engine.add_request("a", PROMPT, _params())
    engine.add_request("b", PROMPT, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
    _same(finished["a"], llama.generate([PROMPT], _params(), use_tqdm=False)[0])
    assert finished["b"].activations is None
    assert engine.collective_rpc("lens_status")[0]["stored_requests"] == 0


@pytest.fixture(scope="module")
def async_llm():
    """(engine, event loop): AsyncLLM's output handler lives on the loop of its first request."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = keep_alive(AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(model_path("llama")), **ENGINE_DEFAULTS)))
    return engine, keep_alive(asyncio.new_event_loop())


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_async_llm_generate_gets_results_on_the_final_output(async_llm, llama, kind):
    engine, loop = async_llm

    async def run(rid: str, sp: SamplingParams):
        return [o async for o in engine.generate(PROMPT, sp, request_id=rid)]

    outs = loop.run_until_complete(run(f"req-{kind.name}", _params(n=2, seed=5, temperature=1.0, output_kind=kind)))
    final = outs[-1]
    assert final.finished and all(o.activations is None for o in outs[:-1] if hasattr(o, "activations"))
    ref = llama.generate([PROMPT], _params(n=2, seed=5, temperature=1.0), use_tqdm=False)[0]
    # a streamed parent yields each sample's updates as they come: results sit on each sample's last one
    tokens: dict[int, list] = {}
    last = {}
    for o in outs:
        for c in o.outputs:
            tokens[c.index] = (
                (tokens.get(c.index, []) + list(c.token_ids)) if kind == RequestOutputKind.DELTA else list(c.token_ids)
            )
            last[c.index] = c
    assert [tokens[c.index] for c in ref.outputs] == [list(c.token_ids) for c in ref.outputs]
    for r in ref.outputs:
        got = last[r.index]
        assert torch.equal(got.activations["residual_stream"], r.activations["residual_stream"])
        assert got.activations["layers"] == [0, 3] and got.hook_results == r.hook_results
    assert torch.equal(final.activations["residual_stream"], ref.outputs[0].activations["residual_stream"])


def test_vllm_openai_server_without_our_http_plugin_is_no_consumer(monkeypatch):
    """vLLM's own API server never reads `.activations`: `AsyncLLM.generate` called there does not make
    the engine a consumer, so capture requests keep being refused (loudly) rather than dropped."""
    import sys
    from types import ModuleType, SimpleNamespace

    from vllm_worker import frontend
    from vllm_worker.plugin import bootstrap as plugin

    client = SimpleNamespace(input_processor=SimpleNamespace())
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.openai.api_server", ModuleType("api_server"))
    assert plugin._async_consumer(client) is False
    assert frontend.consumer_of(client.input_processor) is None
    monkeypatch.delitem(sys.modules, "vllm.entrypoints.openai.api_server")
    assert plugin._async_consumer(client) is True


def test_requests_added_behind_the_engines_back_are_refused(llama):
    """A harness that feeds vLLM's input processor directly (no LLM, LLMEngine.add_request or
    AsyncLLM.generate) has no consumer: refused with the reason, never silently dropped."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    engine = keep_alive(LLMEngine.from_engine_args(EngineArgs(model=str(model_path("llama")), **ENGINE_DEFAULTS)))
    with pytest.raises(ValueError, match="no inspect-lens consumer"):
        engine.input_processor.process_inputs("x", PROMPT, _params(), supported_tasks=engine.get_supported_tasks())


def test_a_second_request_with_an_id_in_flight_is_refused(async_llm, llama):
    """Two requests for results under one client-chosen id (vLLM itself accepts both): the second is refused
    naming `request_id`, and the first still gets its own numbers (its pending entry is not overwritten)."""
    engine, loop = async_llm

    async def run(rid: str, sp: SamplingParams):
        return [o async for o in engine.generate(PROMPT, sp, request_id=rid)]

    async def both():
        first = engine.generate(PROMPT, _params(), request_id="same-id")
        outs = [await first.__anext__()]  # its first tokens are out: it is in flight
        try:
            await run("same-id", _params(max_tokens=3))
        except ValueError as e:
            refused = e
        else:
            refused = None
        return outs + [o async for o in first], refused

    outs, refused = loop.run_until_complete(both())
    assert refused is not None and "request_id" in str(refused) and "already in flight" in str(refused)
    _same(outs[-1], llama.generate([PROMPT], _params(), use_tqdm=False)[0])
    # once it has finished, the id is free again
    again = loop.run_until_complete(run("same-id", _params()))
    _same(again[-1], llama.generate([PROMPT], _params(), use_tqdm=False)[0])


def test_an_async_fetch_that_raises_leaves_nothing_with_the_workers(async_llm, monkeypatch):
    """`AsyncLLM.generate`'s round trip for results fails: the caller gets that error and the workers drop
    what they stored for the request (the HTTP server's fetches take the same path)."""
    from vllm_worker.frontend import fetch as frontend_fetch

    engine, loop = async_llm

    def unreachable(engine_client, todo):  # the round trips' generator, failing at its first RPC
        raise ConnectionError("worker went away")
        yield

    async def run(rid: str):
        return [o async for o in engine.generate(PROMPT, _params(), request_id=rid)]

    monkeypatch.setattr(frontend_fetch, "_fetch_rounds", unreachable)
    with pytest.raises(ConnectionError):
        loop.run_until_complete(run("req-unreachable"))
    monkeypatch.undo()
    assert loop.run_until_complete(engine.collective_rpc("lens_status"))[0]["stored_requests"] == 0
    assert loop.run_until_complete(run("req-after"))[-1].activations["residual_stream"].shape[0] == 2
