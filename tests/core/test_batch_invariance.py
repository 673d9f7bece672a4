"""vLLM's batch-invariant mode as the plugin reads it (`compat.batch_invariance`): where its module is, its
switch, and the ops it replaces — each read from the installed vLLM, and a loud error if vLLM moves them.
The mode itself is not turned on here: on CPU it replaces CPU ops with Triton kernels that cannot run there
(bench/probes/gpu_batch_invariant.py says so on a CPU engine)."""

from __future__ import annotations

import inspect

import pytest

from vllm_worker import compat
from vllm_worker.compat import batch_invariance as bi


def test_the_modes_module_switch_and_environment_are_where_the_plugin_reads_them():
    import vllm.envs

    mod = bi.bi_module()
    v = compat.vllm_version()
    if v in bi.SEEN:
        assert mod.__name__ == bi.SEEN[v]
    assert isinstance(getattr(mod, bi.FLAG), bool)
    assert compat.batch_invariant_mode() is False  # nobody turned it on in this process
    # vLLM's worker turns it on from this variable (`init_batch_invariance`), as `enable_batch_invariant_mode`
    assert "VLLM_BATCH_INVARIANT" in inspect.getsource(mod.init_batch_invariance)
    assert "VLLM_BATCH_INVARIANT" in vllm.envs.environment_variables
    assert "enable_batch_invariant_mode()" in inspect.getsource(mod.init_batch_invariance)
    # it sets the switch the plugin reads
    assert f"{bi.FLAG} = True" in inspect.getsource(mod.enable_batch_invariant_mode)


def test_the_ops_the_projection_runs_are_ones_the_mode_replaces_on_every_device():
    """`worker/projection`'s path under the mode runs `USED_OPS` (tests/unit/test_projection_batch_invariant_
    mode.py); each is registered by `enable_batch_invariant_mode` outside any device-kind branch (its matmul
    overrides are for Ampere / XPU only: Hopper's `mm` stays cuBLAS)."""
    src = inspect.getsource(bi.bi_module().enable_batch_invariant_mode)
    for op in bi.USED_OPS:
        lines = [ln for ln in src.splitlines() if f'"{op}"' in ln]
        assert lines, f"{op} is no longer replaced by vLLM's batch-invariant mode"
        indent = {len(ln) - len(ln.lstrip()) for ln in lines}
        assert min(indent) == 4, f"{op} is registered under a condition now: {lines}"


def test_a_moved_module_or_switch_is_a_loud_error(monkeypatch):
    v = compat.vllm_version()
    monkeypatch.setitem(bi.SEEN, v, "vllm.model_executor.nowhere.batch_invariant")
    with pytest.raises(compat.LensIncompatibleVLLM, match="no batch-invariance module"):
        bi.bi_module()
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert compat.batch_invariant_mode() is False  # not asked for: a worker serves as without it
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")  # asked for: never a silent "off"
    with pytest.raises(compat.LensIncompatibleVLLM, match="no batch-invariance module"):
        compat.batch_invariant_mode()
    monkeypatch.delitem(bi.SEEN, v)
    mod = bi.bi_module()  # an unlisted release finds it by trying both places
    monkeypatch.delattr(mod, bi.FLAG)
    with pytest.raises(compat.LensIncompatibleVLLM, match=bi.FLAG):
        compat.batch_invariant_mode()
