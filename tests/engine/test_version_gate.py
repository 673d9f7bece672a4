"""The release gate where a user meets it: a real engine start on a vLLM that reports an untested release is
refused with the class the plugin raises for an incompatible vLLM (naming the newest tested release and the
override); with VLLM_LENS_ALLOW_UNTESTED_VLLM=1 the same start serves, and its capture equals the suite's
own engine on the installed (tested) release."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from vllm import SamplingParams

from support import TESTS, pythonpath
from support.engines import model_path
from vllm_worker.compat import version

UNTESTED = (max(version.TESTED)[0], max(version.TESTED)[1] + 1)


def _start(allow: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    env.pop("VLLM_LENS_ALLOW_UNTESTED_VLLM", None)
    if allow is not None:
        env["VLLM_LENS_ALLOW_UNTESTED_VLLM"] = allow
    cmd = [sys.executable, str(TESTS / "support" / "version_run.py"), str(model_path("llama")), *map(str, UNTESTED)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    return {**json.loads(line[len("RESULT ") :]), "stderr": done.stderr}


def test_an_untested_vllm_is_refused_at_engine_start():
    got = _start(None)
    assert got.get("raised") == version.LensIncompatibleVLLM.__name__, got
    newest = max(version.TESTED)
    assert f"newest tested: {newest[0]}.{newest[1]}" in got["message"]
    assert "VLLM_LENS_ALLOW_UNTESTED_VLLM=1" in got["message"]


def test_the_override_starts_it_with_a_warning_and_the_same_numbers(llama):
    got = _start("1")
    assert "raised" not in got, got
    assert "VLLM_LENS_ALLOW_UNTESTED_VLLM=1: starting on an untested vLLM" in got["stderr"]
    sp = SamplingParams(max_tokens=2, temperature=0, extra_args={"output_residual_stream": [1]})
    ref = llama.generate(["the water"], sp, use_tqdm=False)[0]
    assert got["tokens"] == list(ref.outputs[0].token_ids)
    torch.testing.assert_close(torch.tensor(got["capture"]), ref.activations["resid_post"].float())
