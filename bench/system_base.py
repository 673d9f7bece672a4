"""What the benchmarked systems share, whatever their library: the prompts they all get, and how a
vLLM-based one sizes its engine (engines run side by side, so each is given its room)."""

from __future__ import annotations

import gc
import os
from typing import Any


def prompts(n: int, length: int) -> list[list[int]]:
    """Deterministic token-id prompts (distinct per index: no prefix-cache sharing between them)."""
    return [[(1000 + 37 * i + 101 * j) % 30000 + 100 for j in range(length)] for i in range(n)]


def engine_room(device: str) -> dict:
    """Engine arguments every vLLM-based system shares: memory (engines run side by side), batch size, and
    the weights' format (BENCH_LOAD_FORMAT=dummy: random weights of the real shape)."""
    if device == "cpu":
        kw: dict = {"kv_cache_memory_bytes": int(os.environ.get("BENCH_KV_BYTES", str(2 << 30)))}
    else:
        kw = {"gpu_memory_utilization": float(os.environ.get("BENCH_GPU_UTIL", "0.2")), "max_num_seqs": 256}
    if os.environ.get("BENCH_LOAD_FORMAT"):
        kw["load_format"] = os.environ["BENCH_LOAD_FORMAT"]
    return kw


def kv_cache_tokens(llm) -> dict:
    """The engine's KV cache in tokens: engines started side by side can starve one of it (run.py checks)."""
    cc = llm.llm_engine.vllm_config.cache_config
    return {"kv_cache_tokens": int(cc.num_gpu_blocks) * int(cc.block_size)} if cc.num_gpu_blocks else {}


def freeze_engine_heap(_worker: Any = None) -> int:
    """Run in each vLLM worker (`collective_rpc`): its heap frozen as this process's is after the warm-up
    (`BENCH_ENGINE_GC_FREEZE=1`): vLLM freezes an engine core's heap at start-up only, so a full collection
    there walks everything the warm-up made."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
