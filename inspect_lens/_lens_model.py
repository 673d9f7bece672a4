"""Helpers that need the `vllm-lens/<model>` provider behind an Inspect `Model` (shape, layers, tokens)."""

from __future__ import annotations

from typing import Any

from inspect_ai.model import Model

from .provider import VLLMLensAPI


def lens_api(model: Model) -> VLLMLensAPI:
    if not isinstance(model.api, VLLMLensAPI):
        raise ValueError(f"inspect-lens solvers and scorers need the vllm-lens/<model> provider, got {model.name!r} "
                         f"({type(model.api).__name__}); run with --model vllm-lens/<model>")
    return model.api


async def resolve_layers(model: Model, layers: Any) -> list[int]:
    """None / "middle" -> [n_layers // 2]; an int or a list of ints (negative counts from the end)."""
    n = (await lens_api(model).lens_info())["n_layers"]
    if layers is None or layers == "middle":
        return [n // 2]
    items = [layers] if isinstance(layers, int) else list(layers)
    out = []
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int) or not -n <= v < n:
            raise ValueError(f"layers: {v!r} is not a layer of this model (valid: {-n}..{n - 1}, or 'middle')")
        out.append(v % n)
    return out


async def count_tokens(model: Model, text: str) -> list[int]:
    return await lens_api(model).tokenize(text)
