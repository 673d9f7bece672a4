"""vLLM's default compiled mode: the plugin no longer forces eager, its taps are traced into the graph.

scripts/test.sh runs tests/core again in a LENS_TEST_COMPILED=1 pytest process (every engine of that
session compiled), this file first (`run_first`), so the capture / steering / cache / hook tests run on
compiled engines as well. In the eager session the tests here run too (same assertions, eager engines).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from vllm import SamplingParams

from support import TESTS
from support.engines import COMPILED, make_engine, model_path
from support.reference import hf_model, residuals
from vllm_worker import Hook, SteeringVector

pytestmark = pytest.mark.run_first
PROMPTS = [
    "the water of people will come down to the side",
    "a long thing to see him",
    "they said the first people could",
    "how many water did she write",
]


def _plain_run(prompts: list[str], max_tokens: int) -> dict:
    env = dict(os.environ, VLLM_LENS_DISABLE="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(TESTS / "support" / "plain_run.py"),
            str(model_path("llama")),
            json.dumps(prompts),
            str(max_tokens),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert line, proc.stderr[-3000:]
    return json.loads(line[0][7:])


def test_graph_compiled_without_taps_is_never_reused():
    """First a plugin-disabled engine compiles the model into the shared compile cache (same config as
    the session's default engine); then our engine starts and must trace its own graph with the taps.
    Were the tap-less graph reused, the taps would not run and the forward pass raises loudly."""
    plain = _plain_run(PROMPTS[:2], 6)
    assert plain["enforce_eager"] is (not COMPILED)
    llm = make_engine("llama")  # the session's default engine: started after the plugin-free run
    assert llm.llm_engine.vllm_config.model_config.enforce_eager is (not COMPILED)
    if COMPILED:
        from vllm.config import CompilationMode

        assert llm.llm_engine.vllm_config.compilation_config.mode != CompilationMode.NONE
    rt = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner._lens_runtime
    before = rt.steps_with_features
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, extra_args={"output_residual_stream": [0, 3]})
    outs = llm.generate(PROMPTS[:2], sp, use_tqdm=False)
    assert rt.steps_with_features >= before + 6
    hf = hf_model("llama")
    for o, toks in zip(outs, plain["tokens"]):
        assert list(o.outputs[0].token_ids) == toks
        ids = list(o.prompt_token_ids) + toks
        ref, _ = residuals(hf, ids[:-1])
        acts = o.activations["residual_stream"]
        assert acts.shape == (2, len(ids) - 1, 128)
        assert (acts[0] - ref[0]).abs().max() <= 1e-4 and (acts[1] - ref[3]).abs().max() <= 1e-4


def test_batch_mates_of_hooks_and_steering_get_the_numbers_they_get_alone():
    """Plain requests batched with hooked, steered and capturing ones: same tokens and logprobs as when
    they run alone (no batch-mate forces another execution mode on them)."""
    llm = make_engine("llama")

    def double(ctx, h):
        ctx.saved["calls"] = ctx.saved.get("calls", 0) + 1
        return h * 2

    v = torch.randn(1, 128, generator=torch.Generator().manual_seed(3)) * 4
    extra = [
        None,
        {"apply_hooks": [Hook(double, [1])]},
        None,
        {"apply_steering_vectors": [SteeringVector(v, [2])], "output_residual_stream": [2]},
    ]
    sps = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3, extra_args=e) for e in extra]
    mixed = llm.generate(PROMPTS, sps, use_tqdm=False)
    alone = llm.generate([PROMPTS[0], PROMPTS[2]], sps[0], use_tqdm=False)
    for i, a in zip((0, 2), alone):
        m = mixed[i].outputs[0]
        assert m.token_ids == a.outputs[0].token_ids
        for lm, la in zip(m.logprobs, a.outputs[0].logprobs):
            assert lm.keys() == la.keys()
            assert all(abs(lm[k].logprob - la[k].logprob) <= 1e-5 for k in lm)
    assert mixed[1].hook_results["0"]["calls"] >= 6
    assert mixed[3].activations["residual_stream"].shape[0] == 1
