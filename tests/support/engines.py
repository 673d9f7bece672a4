"""Real in-process vLLM engines on CPU, shared by a session (VLLM_ENABLE_V1_MULTIPROCESSING=0 starts in
seconds), and the models they load. Importing this module sets the environment the engines need, so it
is imported before vLLM (conftest imports it first)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# Test models are tiny: 128 MiB of KV cache per engine (the GiB-granular VLLM_CPU_KVCACHE_SPACE would
# override the per-engine size, so it is dropped; every test engine passes KV_BYTES instead).
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
KV_BYTES = 128 << 20
# LENS_TEST_COMPILED=1 (a pytest process of its own in scripts/test.sh): every engine of the session runs
# in vLLM's default compiled mode instead of eager, so the tests under tests/core run on both.
COMPILED = os.environ.get("LENS_TEST_COMPILED", "") == "1"
ENGINE_DEFAULTS = dict(
    dtype="float32", max_model_len=512, seed=0, kv_cache_memory_bytes=KV_BYTES, enforce_eager=not COMPILED
)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# every inner hook point tapped (off by default: tests/core/test_points.py checks the default too); servers
# started by the tests inherit it
os.environ.setdefault("VLLM_LENS_POINTS", "all")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from support import tiny_models  # noqa: E402


def models_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "inspect-lens" / "test-models-v1"


def model_path(name: str) -> Path:
    if name == "smollm2":
        from vllm_worker.shipped_model import shipped_model_path

        return shipped_model_path()
    return tiny_models.build(name, models_root())


_ENGINES: dict = {}
_KEEP: list = []


def keep_alive(engine):
    """Hold an engine until the session ends: shutting one down (explicitly or by garbage collection)
    tears down the process-wide distributed state that every in-process engine shares."""
    _KEEP.append(engine)
    return engine


def shutdown_all() -> None:
    """At the session's end, while pytest still holds the streams vLLM logs to: every engine stopped and
    its processes waited for (left to vLLM's exit-time finalizers, an engine core killed after 5 s logs
    `--- Logging error ---` tracebacks into closed streams and leaves its shared memory behind)."""
    from vllm import LLM
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.llm_engine import LLMEngine

    from vllm_worker import compat

    held = [*_ENGINES.values(), *_KEEP]  # (`_KEEP` also holds what an engine needs, e.g. its event loop)
    engines = list({id(e): e for e in held if isinstance(e, (LLM, LLMEngine, AsyncLLM))}.values())
    _ENGINES.clear()
    _KEEP.clear()
    loops = [x for x in held if isinstance(x, asyncio.AbstractEventLoop) and not x.is_closed()]
    for engine in reversed(engines):  # the newest first: the first in-process engine made the shared state
        compat.shutdown_engine(engine)
    for loop in loops:  # an AsyncLLM's tasks live on the loop of its first request: ended there, then closed
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.close()


MOE = {"mixtral", "qwen3_moe"}


def _share_expert_group() -> None:
    """In-process engines share one process's distributed state, made by the first engine: vLLM creates
    the expert-parallel group only when that first model is an MoE one. A later MoE engine gets the same
    single-rank group that an MoE engine of its own process would have made (test processes only)."""
    import torch
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized() and ps._EP is None:
        world = ps.get_world_group()
        backend = torch.distributed.get_backend(world.device_group)
        ps._EP = ps.init_model_parallel_group([[0]], world.local_rank, backend, group_name="ep")


# families with multi-head latent attention (see make_engine)
CPU_MLA_FAMILIES = {"deepseek_v2"}


def make_engine(name: str, **kwargs):
    """One cached in-process engine per (model, settings)."""
    key = (name, tuple(sorted(kwargs.items())))
    if key not in _ENGINES:
        from vllm import LLM

        if name in MOE:
            _share_expert_group()
        opts = dict(ENGINE_DEFAULTS)
        if name in CPU_MLA_FAMILIES:
            # vllm-cpu prefers its AMX MLA kernels on a CPU with AMX tiles, and they refuse float32 weights:
            # the reference CPU MLA backend runs float32 on every x86 CPU (the HF comparison needs float32)
            opts["attention_backend"] = "CPU_MLA"
        opts.update(kwargs)
        _ENGINES[key] = LLM(str(model_path(name)), **opts)
    return _ENGINES[key]


def parallel_engine(name: str, backend: str = "mp", **parallel):
    """An engine whose workers are processes of their own (vLLM's `mp` executor, or `backend`: "ray"; TP /
    PP / EP), kept for the session: one per (model, backend, layout), so test modules asking for the same
    layout share it. vLLM-cpu binds one OMP thread per worker ("0|1": the 2-core CI machine) and reads that
    setting when the engine starts, so the env cache frozen by earlier engines is dropped first."""
    key = ("parallel", name, backend, tuple(sorted(parallel.items())))
    if key not in _ENGINES:
        _ENGINES[key] = _start_parallel(name, backend, **parallel)
    return _ENGINES[key]


def _start_parallel(name: str, backend: str, **parallel):
    from vllm import LLM

    from support import pythonpath

    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "PYTHONPATH": pythonpath(os.environ.get("PYTHONPATH"))}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import vllm.envs

    vllm.envs.disable_envs_cache()
    try:
        llm = LLM(
            str(model_path(name)),
            **ENGINE_DEFAULTS,
            distributed_executor_backend=backend,
            enable_prefix_caching=False,
            **parallel,
        )
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return keep_alive(llm)
