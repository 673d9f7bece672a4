"""Inspect entry point: registers the `vllm-lens` model provider (heavy imports stay lazy)."""

from inspect_ai.model import modelapi


@modelapi(name="vllm-lens")
def vllm_lens():
    from .provider import VLLMLensAPI

    return VLLMLensAPI
