"""A random-weight Llama-shaped model with >= 300M parameters (SmolLM2's tokenizer), so per-token compute
is visible next to per-layer Python cost. Written once to the cache; prints its folder."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from vllm_worker.shipped_model import cache_root, shipped_model_path

NAME = "bench-llama-370m-random-v1"


def random_llama(name: str, min_params: float = 0, **shape: int) -> Path:
    """A random-weight Llama (`shape`: LlamaConfig sizes) with SmolLM2's tokenizer, written once to the
    cache as `name`; its folder."""
    dst = cache_root() / name
    if (dst / "config.json").exists():
        return dst
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-5,
        torch_dtype="float32",
        **shape,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert n >= min_params, n
    tmp = dst.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in shipped_model_path().iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            shutil.copy(f, tmp / f.name)
    tmp.rename(dst)
    print(f"built {name}: {n / 1e6:.0f}M parameters", file=sys.stderr)
    return dst


def bench_model_path() -> Path:
    return random_llama(
        NAME,
        300e6,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
    )


if __name__ == "__main__":
    print(bench_model_path())
