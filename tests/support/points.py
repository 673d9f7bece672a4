"""Helpers shared by the hook-point tests (tests/core/test_points.py, test_neuron_points.py)."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.engines import COMPILED, make_engine

PROMPTS = ["the water of time was long", "a day"]
# compiled mode: dense fused, dense unfused, parallel-residual and MoE families (eager runs them all)
COMPILED_FAMILIES = ("llama", "gpt2", "gpt_neox", "mixtral")
# relative to the largest value; Gemma 2's soft-capped attention differs from HF's at ~2e-4 on vLLM's CPU
# attention (every point alike, from layer 0's attention on): a numeric, not a placement, difference
TOL = {"gemma2": 1e-3}


def engine(family: str):
    """The family's shared engine; in compiled mode only the families it covers."""
    if COMPILED and family not in COMPILED_FAMILIES:
        pytest.skip(f"compiled mode covers {', '.join(COMPILED_FAMILIES)}")
    return make_engine(family)


def close(got: torch.Tensor, ref: torch.Tensor, what: str, family: str = "") -> None:
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    tol = TOL.get(family, 1e-4)
    assert got.shape == ref.shape and err < tol, (
        f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)}, rel {err:.2e}"
    )


def ids(o) -> list[int]:
    """The positions a capture covers: the prompt and every generated token but the last."""
    return list(o.prompt_token_ids) + list(o.outputs[0].token_ids)[:-1]


def vec(seed: int, d: int = 128, norm: float = 3.0) -> torch.Tensor:
    v = torch.randn(1, d, generator=torch.Generator().manual_seed(seed))
    return v / v.norm() * norm


def refused(llm, extra: dict, *needles: str) -> None:
    with pytest.raises(ValueError) as info:
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, extra_args=extra), use_tqdm=False)
    for n in needles:
        assert n in str(info.value), str(info.value)
