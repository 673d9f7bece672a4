"""HF transformers reference: the residual stream after each decoder layer, optionally with a
steering edit applied by a plain torch forward hook — the numbers our plugin must reproduce."""

from __future__ import annotations

import functools
from typing import Callable

import torch


def _outside_vllm(hf_config):
    """vLLM's Transformers backend (GPT-NeoX here) decorates HF model classes for its compiler: built in
    the same process, the reference must say "no vLLM compilation" or its constructor asks for a config."""
    import contextlib
    import sys

    if "vllm" not in sys.modules:
        return contextlib.nullcontext()
    from types import SimpleNamespace

    from vllm.config import CompilationConfig, CompilationMode, VllmConfig, set_current_vllm_config

    config = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.NONE))
    object.__setattr__(config, "model_config", SimpleNamespace(hf_config=hf_config))  # what the backend reads
    return set_current_vllm_config(config)


@functools.cache
def hf_model(name: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    from support.engines import model_path

    with _outside_vllm(AutoConfig.from_pretrained(str(model_path(name)))):
        m = AutoModelForCausalLM.from_pretrained(str(model_path(name)), dtype=torch.float32)
    m.eval()
    return m


def decoder_layers(model) -> list[torch.nn.Module]:
    for path in ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers"):
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


# Where each point lives in the HF implementation of a family (the reference's own table, written from
# transformers' modelling code — not the plugin's): attention / MLP block whose output is added to the
# stream, and the module whose input is the stream between them (None: parallel residual).
HF_POINTS = {
    "gpt2": ("attn", "mlp", "ln_2"),
    "opt": ("self_attn", "fc2", "final_layer_norm"),
    "gpt_neox": ("attention", "mlp", None),
    "gemma2": ("post_attention_layernorm", "post_feedforward_layernorm", "pre_feedforward_layernorm"),
    "gemma3": ("post_attention_layernorm", "post_feedforward_layernorm", "pre_feedforward_layernorm"),
}
HF_DEFAULT = ("self_attn", "mlp", "post_attention_layernorm")
# the attention's output projection, whose input is z (the heads' outputs, concatenated)
HF_Z = {"gpt2": "attn.c_proj", "opt": "self_attn.out_proj", "gpt_neox": "attention.dense"}
# the module whose input is what the MLP reads (after the pre-MLP norm): OPT has no MLP module
HF_MLP_IN = {"opt": "fc1"}
# the dense MLP's down projection, whose input is mlp_post (the hidden activation): absent in MoE layers
HF_MLP_POST = {"gpt2": "mlp.c_proj", "opt": "fc2", "gpt_neox": "mlp.dense_4h_to_h"}

PointEdit = Callable[[str, int, torch.Tensor], torch.Tensor | None]  # (point, layer, (T, d)) -> new value


def point_activations(
    model, family: str, token_ids: list[int], edit: PointEdit | None = None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """({point: (n_layers, T, d)}, logits (T, vocab)) of one sequence by HF hooks, with an optional edit at
    any point (applied before the value is recorded, like steering)."""
    attn_name, mlp_name, mid_name = HF_POINTS.get(family, HF_DEFAULT)
    layers = decoder_layers(model)
    names = (
        "resid_pre",
        "z",
        "attn_out",
        "resid_mid",
        "mlp_in",
        "router_logits",
        "mlp_post",
        "expert_ids",
        "mlp_out",
        "resid_post",
    )
    got: dict[str, list] = {p: [None] * len(layers) for p in names}
    handles = []

    def edited(point: str, i: int, h: torch.Tensor) -> torch.Tensor:
        batched = h.dim() == 3  # (1, T, d); HF OPT runs its MLP on (T, d)
        x = h[0] if batched else h
        if edit is not None:
            new = edit(point, i, x)
            if new is not None:
                x = new
                h = new.unsqueeze(0) if batched else new
        got[point][i] = x.detach().clone()
        return h

    def out_hook(point: str, i: int):
        def hook(mod, args, out):
            h = out[0] if isinstance(out, tuple) else out
            h2 = edited(point, i, h)
            if h2 is h:
                return None
            return (h2,) + tuple(out[1:]) if isinstance(out, tuple) else h2

        return hook

    def in_place_pre_hook(point: str, i: int):
        def hook(mod, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            h2 = edited(point, i, h)
            if h2 is not h:
                h.copy_(h2)  # in place: the layer keeps this tensor as its residual too

        return hook

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(in_place_pre_hook("resid_pre", i), with_kwargs=True))
        o_proj = layer
        for part in HF_Z.get(family, "self_attn.o_proj").split("."):
            o_proj = getattr(o_proj, part)
        handles.append(o_proj.register_forward_pre_hook(in_place_pre_hook("z", i), with_kwargs=True))
        handles.append(getattr(layer, attn_name).register_forward_hook(out_hook("attn_out", i)))
        if mid_name is not None:
            handles.append(
                getattr(layer, mid_name).register_forward_pre_hook(in_place_pre_hook("resid_mid", i), with_kwargs=True)
            )
        mlp_in = layer
        for part in HF_MLP_IN.get(family, "mlp").split("."):
            mlp_in = getattr(mlp_in, part)
        handles.append(mlp_in.register_forward_pre_hook(in_place_pre_hook("mlp_in", i), with_kwargs=True))
        down = layer
        for part in HF_MLP_POST.get(family, "mlp.down_proj").split("."):
            down = getattr(down, part, None)
        if isinstance(down, torch.nn.Module):
            handles.append(down.register_forward_pre_hook(in_place_pre_hook("mlp_post", i), with_kwargs=True))
        gate = getattr(getattr(layer, mlp_name), "gate", None)
        if isinstance(gate, torch.nn.Module) and family in ("mixtral", "qwen3_moe"):  # HF's top-k router
            handles.append(gate.register_forward_hook(out_hook("router_logits", i)))

            def ids_hook(mod, args, out, i=i):
                got["expert_ids"][i] = out[2].detach().clone()

            handles.append(gate.register_forward_hook(ids_hook))
        handles.append(getattr(layer, mlp_name).register_forward_hook(out_hook("mlp_out", i)))
        handles.append(layer.register_forward_hook(out_hook("resid_post", i)))
    try:
        with torch.no_grad():
            out = model(torch.tensor([token_ids]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {p: torch.stack(v) for p, v in got.items() if v[0] is not None}, out.logits[0]
