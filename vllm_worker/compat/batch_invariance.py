"""vLLM's batch-invariant mode (`VLLM_BATCH_INVARIANT=1`): whether it is on in this process, and the aten ops
it replaces there with kernels whose per-row result does not depend on the batch. Its worker turns it on
while initialising the device (before the model loads), process-wide; a probe projection that should not
depend on the batch either must then go through those ops (`worker/projection`)."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from vllm_worker.compat.version import LensIncompatibleVLLM, require, vllm_version

# Where the mode's module lives, by the releases it was read on: vllm/model_executor/layers/ up to 0.26 at
# least, vllm/model_executor/determinism/ by 0.32. A release between or after tries both, in this order.
OLD = "vllm.model_executor.layers.batch_invariant"
NEW = "vllm.model_executor.determinism.batch_invariant"
SEEN: dict[tuple[int, int], str] = {(0, 26): OLD, (0, 32): NEW}
# The mode's own switch: set by its `enable_batch_invariant_mode()`, which also installs the overrides.
FLAG = "_batch_invariant_MODE"
# The aten ops the projection runs under the mode (`worker/projection`): the mode replaces each of these on
# every device kind it supports, in every release read (tests/core/test_batch_invariance.py reads the
# installed release's `enable_batch_invariant_mode` for them).
USED_OPS = ("aten::mean.dim",)


def bi_module() -> ModuleType:
    """The installed vLLM's batch-invariance module, or `LensIncompatibleVLLM` naming where it was looked for."""
    v = vllm_version()
    names = [SEEN[v]] if v in SEEN else ([NEW, OLD] if v > (0, 26) else [OLD, NEW])
    for name in names:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        require(mod, FLAG, name)
        require(mod, "init_batch_invariance", name)
        return mod
    raise LensIncompatibleVLLM(f"vLLM internal moved: no batch-invariance module at {' or '.join(names)} (vLLM {v})")


def batch_invariant_mode() -> bool:
    """Whether vLLM's batch-invariant mode is on in this process (its overrides installed). A moved module
    is an error only where the mode was asked for (`VLLM_BATCH_INVARIANT`): without it nothing turns it on."""
    try:
        mod = bi_module()
    except LensIncompatibleVLLM:
        if os.environ.get("VLLM_BATCH_INVARIANT", "0").strip() in ("", "0"):
            return False
        raise
    return bool(getattr(mod, FLAG))


def enable_batch_invariant_mode() -> None:
    """Turn the mode on in this process as vLLM's worker does (`VLLM_BATCH_INVARIANT=1`, then its
    `init_batch_invariance()`), for benchmarks and checks outside an engine. On a GPU call it before the first
    matmul: it sets cuBLAS's workspace through the environment."""
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    bi_module().init_batch_invariance()
