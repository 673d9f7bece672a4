"""Helpers that need the `vllm-lens/<model>` provider behind an Inspect `Model` (shape, layers, tokens)."""

from __future__ import annotations

from typing import Any

from inspect_ai.model import Model

from .provider import VLLMLensAPI


def lens_api(model: Model) -> VLLMLensAPI:
    if not isinstance(model.api, VLLMLensAPI):
        raise ValueError(
            f"inspect-lens solvers and scorers need the vllm-lens/<model> provider, got {model.name!r} "
            f"({type(model.api).__name__}); run with --model vllm-lens/<model>"
        )
    return model.api


async def resolve_layers(model: Model, layers: Any) -> list[int]:
    """None / "middle" -> [n_layers // 2]; an int or a list of ints (negative counts from the end),
    validated exactly as the server validates `output_residual_stream`."""
    from vllm_worker.protocol.spec import layer_list

    n = (await lens_api(model).lens_info())["n_layers"]
    if layers is None or layers == "middle":
        return [n // 2]
    return layer_list(layers, "layers", n)


async def tokenize(model: Model, text: str) -> list[int]:
    return await lens_api(model).tokenize(text)
