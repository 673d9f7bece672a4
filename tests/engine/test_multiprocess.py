"""The default multiprocess engine (separate EngineCore and worker processes): payloads cross
msgspec without pickle, the plugin loads in the worker, and a user's worker extension survives."""

from __future__ import annotations

import os

import pytest
import torch
from vllm import SamplingParams

from support import pythonpath
from support.engines import ENGINE_DEFAULTS, keep_alive, model_path
from vllm_worker import SteeringVector


@pytest.fixture(scope="session")
def mp_llama():
    from vllm import LLM

    old = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "PYTHONPATH")}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ["PYTHONPATH"] = pythonpath(old["PYTHONPATH"])
    import vllm.envs

    vllm.envs.disable_envs_cache()  # earlier engines froze env values; these settings must be read
    try:
        llm = LLM(str(model_path("llama")), **ENGINE_DEFAULTS, worker_extension_cls="support.user_ext.UserExtension")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return keep_alive(llm)


def test_multiprocess_matches_inprocess_and_keeps_user_extension(mp_llama, llama):
    assert mp_llama.collective_rpc("user_ping", args=(41,)) == [42]
    status = mp_llama.collective_rpc("lens_status")[0]
    assert status["layers"] == [0, 1, 2, 3] and status["tp_rank"] == 0
    assert mp_llama.llm_engine.vllm_config.model_config.enforce_eager is True
    v = torch.randn(1, 1, 128, generator=torch.Generator().manual_seed(1)) * 3
    sp = SamplingParams(
        max_tokens=5,
        temperature=0,
        ignore_eos=True,
        extra_args={
            "output_residual_stream": [0, 3],
            "apply_steering_vectors": [SteeringVector(v, [1], position_indices=[2])],
        },
    )
    prompts = ["the water of people will come", "a long thing to see him"]
    a = mp_llama.generate(prompts, sp, use_tqdm=False)
    b = llama.generate(prompts, sp, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert torch.equal(x.activations["residual_stream"], y.activations["residual_stream"])
    after = mp_llama.collective_rpc("lens_status")[0]
    assert after["stored_requests"] == 0 and after["steps_with_features"] > status["steps_with_features"]


def test_named_vector_by_reference_across_processes(mp_llama, llama):
    """A registered vector pushed to the worker process and named by reference there (its id crosses
    msgspec, the rows came by RPC): the numbers of the same tensor inline in the in-process engine."""
    v = torch.randn(128, generator=torch.Generator().manual_seed(2)) * 3
    mp_llama.register_vector("mp-dir", v)
    try:
        before = mp_llama.collective_rpc("lens_status")[0]
        assert before["held_vectors"] >= 1

        def sp(steer):
            extra = {"output_residual_stream": [0, 3], "apply_steering_vectors": [steer]}
            return SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, extra_args=extra)

        named = mp_llama.generate(["the water of people will come"], sp(SteeringVector(name="mp-dir", layer_indices=[1, 2], op="ablate")), use_tqdm=False)[0]  # fmt: skip
        inline = llama.generate(["the water of people will come"], sp(SteeringVector(v.expand(2, 128).clone(), [1, 2], op="ablate")), use_tqdm=False)[0]  # fmt: skip
        assert named.outputs[0].token_ids == inline.outputs[0].token_ids
        assert torch.equal(named.activations["residual_stream"], inline.activations["residual_stream"])
        after = mp_llama.collective_rpc("lens_status")[0]
        assert after["vector_refs_resolved"] == before["vector_refs_resolved"] + 1  # by reference, not bytes
        # the same rows inline cross the real IPC as one row and the count (`spec._wire`): the numbers of
        # the dense rows the reference resolved to
        again = mp_llama.generate(["the water of people will come"], sp(SteeringVector(v.expand(2, 128).clone(), [1, 2], op="ablate")), use_tqdm=False)[0]  # fmt: skip
        assert again.outputs[0].token_ids == named.outputs[0].token_ids
        assert torch.equal(again.activations["residual_stream"], named.activations["residual_stream"])
        assert mp_llama.collective_rpc("lens_status")[0]["vector_refs_resolved"] == after["vector_refs_resolved"]
    finally:
        mp_llama.delete_vector("mp-dir")


def test_rpc_sent_without_waiting_answers_in_order(mp_llama, llama):
    """`compat.send_rpc`: RPCs sent at once to the engine core process are each answered, as
    `collective_rpc` answers them; an in-process engine core has no such client (None: callers wait)."""
    from vllm_worker import compat

    waits = [compat.send_rpc(mp_llama, "user_ping", k) for k in (1, 2, 3)]
    assert all(w is not None for w in waits)
    assert [w() for w in waits if w is not None] == [[2], [3], [4]]
    assert compat.send_rpc(llama, "user_ping", 1) is None and not compat.rpc_elsewhere(llama)


def test_overlapped_fetch_gives_the_results_of_one_round_trip(mp_llama, llama, monkeypatch):
    """64 requests x 4 probes (two layers, one and two outputs) fetched in 4 round trips sent at once
    (`VLLM_LENS_FETCH_OVERLAP`) and in one: the same scores and aggregates bit for bit, and the in-process
    engine's; the worker holds nothing afterwards. (The first fetch of an engine is never split: it asks
    whether the workers share this machine.)"""
    from vllm_worker.counters import FETCH_OVERLAP

    names = [f"ov{j}" for j in range(4)]
    for j, name in enumerate(names):
        for llm in (mp_llama, llama):
            w = torch.randn(1 + j % 2, 128, generator=torch.Generator().manual_seed(10 + j))
            llm.load_probe(name, weight=w, bias=torch.zeros(1 + j % 2), layers=[1 + 2 * (j // 2)])
    try:
        prompts = [{"prompt_token_ids": [(7 * i + k) % 200 + 5 for k in range(6 + i % 5)]} for i in range(64)]
        extra = {"output_probe_scores": {n: {"aggregate": ["mean", "max", "last", "ema:0.9"]} for n in names}}
        sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, extra_args=extra)

        def run(llm, overlap: str) -> tuple[list, int]:
            monkeypatch.setenv("VLLM_LENS_FETCH_OVERLAP", overlap)
            before = FETCH_OVERLAP["round_trips"]
            outs = llm.generate(prompts, sp, use_tqdm=False)
            got = [(o.activations["probe_scores"], o.activations["probe_aggregates"]) for o in outs]
            return got, FETCH_OVERLAP["round_trips"] - before

        mp_llama.generate(prompts[:1], sp, use_tqdm=False)  # a first fetch asks where the workers run
        split, trips = run(mp_llama, "4")
        assert trips == 4  # 256 items: four round trips of 64
        one, trips1 = run(mp_llama, "1")
        inproc, trips2 = run(llama, "4")
        assert trips1 == 0 and trips2 == 0  # one round trip; the in-process engine never splits
        for a, b, c in zip(split, one, inproc, strict=True):
            for name in names:
                for x, y in ((a[0][name], b[0][name]), (a[0][name], c[0][name])):
                    assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
                assert list(a[1][name]) == list(b[1][name]) == ["mean", "max", "last", "ema:0.9"]
                for agg in a[1][name]:
                    for y in (b[1][name][agg], c[1][name][agg]):
                        assert a[1][name][agg].dtype == y.dtype and torch.equal(a[1][name][agg], y)
        assert split[0][0]["ov1"].shape == (11, 2)  # 6 prompt + 6 new - 1 positions, 2 outputs
        assert mp_llama.collective_rpc("lens_status")[0]["stored_requests"] == 0
    finally:
        for name in names:
            mp_llama.delete_probe(name)
            llama.delete_probe(name)
