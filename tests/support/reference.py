"""HF transformers reference: the residual stream after each decoder layer, optionally with a
steering edit applied by a plain torch forward hook — the numbers our plugin must reproduce."""

from __future__ import annotations

import functools
from typing import Callable

import torch


@functools.cache
def hf_model(name: str):
    from transformers import AutoModelForCausalLM

    from support.engines import model_path

    m = AutoModelForCausalLM.from_pretrained(str(model_path(name)), dtype=torch.float32)
    m.eval()
    return m


def decoder_layers(model) -> list[torch.nn.Module]:
    for path in ("model.layers", "transformer.h", "model.decoder.layers"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is not None:
            return list(obj)
    raise AssertionError(f"no layers in {type(model).__name__}")


Edit = Callable[[int, torch.Tensor], torch.Tensor | None]  # (layer, stream (1, T, d)) -> new stream


def residuals(
    model,
    token_ids: list[int],
    edit: Edit | None = None,
    embed_edit: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(streams (n_layers, T, d) after each layer, logits (T, vocab)) for one sequence.

    `embed_edit` changes the stream entering layer 0 (the embeddings), like a layer-0 pre-hook."""
    layers = decoder_layers(model)
    captured: list[torch.Tensor] = [None] * len(layers)  # type: ignore[list-item]
    handles = []
    if embed_edit is not None:
        handles.append(model.get_input_embeddings().register_forward_hook(lambda m, a, out: embed_edit(out)))
    for i, layer in enumerate(layers):

        def hook(mod, args, out, i=i):
            h = out[0] if isinstance(out, tuple) else out
            if edit is not None:
                new = edit(i, h)
                if new is not None:
                    h = new
            captured[i] = h[0].detach().clone()
            if isinstance(out, tuple):
                return (h,) + tuple(out[1:])
            return h

        handles.append(layer.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = model(torch.tensor([token_ids]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return torch.stack(captured), out.logits[0]


def greedy(
    model,
    prompt_ids: list[int],
    n_new: int,
    edit: Edit | None = None,
    embed_edit: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[int]:
    """Greedy continuation by repeated full forward passes (so `edit` sees every position each time)."""
    ids = list(prompt_ids)
    for _ in range(n_new):
        _, logits = residuals(model, ids, edit, embed_edit)
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt_ids) :]


def steer_edit(
    layer_vecs: dict[int, torch.Tensor],
    scale: float = 1.0,
    norm_match: bool = False,
    positions: list[int] | None = None,
) -> Edit:
    """The documented steering formula, done by hand. `layer_vecs[l]` is (d,) or (n_pos, d)."""

    def edit(layer: int, h: torch.Tensor):
        if layer not in layer_vecs:
            return None
        v = layer_vecs[layer].to(h.dtype)
        h = h.clone()
        if positions is None:
            rows = torch.arange(h.shape[1])
            vv = v.expand(h.shape[1], -1)
        else:
            keep = [(i, p) for i, p in enumerate(positions) if p < h.shape[1]]
            rows = torch.tensor([p for _, p in keep], dtype=torch.long)
            vv = v[[i for i, _ in keep]]
        if len(rows) == 0:
            return h
        if norm_match:
            r = h[0, rows]
            vv = vv / vv.norm(dim=-1, keepdim=True) * r.norm(dim=-1, keepdim=True)
        h[0, rows] += scale * vv
        return h

    return edit


def zero_dim_edit(dim: int, layers: set[int] | tuple[int, ...], steer: Edit | None = None) -> Edit:
    """Zero-ablate residual dimension `dim` after `layers` (after an optional steering edit)."""

    def edit(layer: int, h: torch.Tensor):
        if steer is not None:
            steered = steer(layer, h)
            h = h if steered is None else steered
        if layer in layers:
            h = h.clone()
            h[..., dim] = 0
        return h

    return edit


def held_results(llm) -> tuple[int, int]:
    """(result-pool regions handed out and not given back, bytes still announced by running requests) of
    an offline engine, after collecting garbage and giving back what nothing references any more."""
    import gc

    from vllm_worker import frontend

    gc.collect()
    frontend.release_results(llm)
    status = llm.collective_rpc("lens_status")[0]
    return status["result_regions"], (status["result_pool"] or {}).get("expected_bytes", 0)
