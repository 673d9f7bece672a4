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


def test_probe_results_made_while_the_engine_is_idle_are_the_fetchs(mp_llama, llama, monkeypatch):
    """The engine core, idle after the last step (its finished requests named to the runner), makes the
    probe results of the requests waiting for their fetch (`worker/ready_probes`); the fetch hands those out:
    bit for bit what the in-process engine's fetch makes from the same rows (requests that finished at
    different steps, one probe over two layers, aggregates)."""
    g = torch.Generator().manual_seed(5)
    probes = {
        "idle-p": dict(weight=torch.randn(2, 128, generator=g), bias=torch.randn(2, generator=g), layers=[2]),
        "idle-q": dict(weight=torch.randn(1, 256, generator=g), bias=torch.zeros(1), layers=[1, 3]),
    }
    for engine in (mp_llama, llama):
        for name, parts in probes.items():
            engine.load_probe(name, **parts)
    try:
        prompts = ["the water of people will come", "a long thing to see him", "how many water did she", "the side"]
        sps = [
            SamplingParams(
                max_tokens=n,
                temperature=0,
                ignore_eos=True,
                extra_args={"output_probe_scores": {"idle-p": {}, "idle-q": {"aggregate": ["ema:0.5"]}}},
            )
            for n in (3, 5, 8, 8)
        ]
        runs = []
        for _ in range(3):  # (a fetch sent before the engine core's idle step finds nothing made: try again)
            before = mp_llama.collective_rpc("lens_status")[0]["fetch_timings"]
            runs.append(mp_llama.generate(prompts, sps, use_tqdm=False))
            after = mp_llama.collective_rpc("lens_status")[0]["fetch_timings"]
            made_n = after["ready_made"] - before["ready_made"]
            assert after["ready_used"] - before["ready_used"] == made_n
            if made_n >= 2:  # (the last two at least: they finish together)
                break
        assert made_n >= 2
        monkeypatch.setenv("VLLM_LENS_IDLE_PROBES", "0")  # (read per call: the in-process fetch makes them all)
        fetched = llama.generate(prompts, sps, use_tqdm=False)
        for x, y in ((x, y) for made in runs for x, y in zip(made, fetched, strict=True)):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            n_pos = len(x.prompt_token_ids) + len(x.outputs[0].token_ids) - 1
            for name, n_out in (("idle-p", 2), ("idle-q", 1)):
                got = x.activations["probe_scores"][name]
                assert got.shape == (n_pos, n_out) and torch.equal(got, y.activations["probe_scores"][name])
                ax, ay = x.activations["probe_aggregates"][name], y.activations["probe_aggregates"][name]
                assert list(ax) == list(ay) and all(torch.equal(ax[k], ay[k]) for k in ax)
        assert mp_llama.collective_rpc("lens_status")[0]["stored_requests"] == 0
    finally:
        for engine in (mp_llama, llama):
            for name in probes:
                engine.delete_probe(name)
