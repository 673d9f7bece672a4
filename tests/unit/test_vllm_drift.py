"""scripts/vllm-drift.py against the vLLM installed here (its sources read with `ast`, no download): the
touches it finds in compat/ are the ones compat/ makes, its V2 table covers what runner_v2.internals() checks,
and on the installed vLLM (the one the suite passes on) it reports nothing missing that the code does not
already treat as a fallback. If this fails, either vLLM moved (then compat/ fails too) or the script lost sight
of a touch (then its reports would say "same" for an internal it never looked at)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def drift():
    spec = importlib.util.spec_from_file_location("vllm_drift", ROOT / "scripts" / "vllm-drift.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def installed(drift):
    import vllm

    return drift.Source(Path(vllm.__file__).resolve().parent.parent)


def test_finds_the_touches_compat_makes(drift):
    labels = {t.label() for t in drift.compat_touches()}
    for expected in (
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward",  # wrap() on an imported class
        "vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model",  # require() in a loop over names
        "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager.run_pw_graph",
        "vllm.config.model:ModelConfig.max_model_len",  # require() on an instance, by its `where`
        "vllm.envs `VLLM_USE_V2_MODEL_RUNNER`",  # a switch looked up in vllm.envs
        "vllm.config:CUDAGraphMode.FULL",  # an attribute read on an imported class
    ):
        assert expected in labels, expected


def test_v2_table_covers_runner_v2(drift):
    assert drift.v2_table_gaps() == []


def test_installed_vllm_has_every_touch(drift, installed):
    missing = []
    for t in drift.compat_touches():
        status, _ = drift.look(installed, t)
        if status == "missing":
            missing.append(t.label())
    # fallbacks compat/ tries first or second on purpose (an older home of the same name)
    fallbacks = {"vllm.utils.FlexibleArgumentParser"}
    assert sorted(set(missing) - fallbacks) == []


def test_signature_text(drift):
    import ast

    fn = ast.parse("def f(self, a, b=1, *args, c, d=2, **kw): pass").body[0]
    assert drift.signature(fn) == "(self, a, b=, *args, c, d=, **kw)"
