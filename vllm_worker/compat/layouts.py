"""Where the inner hook points live in each model family's decoder layer (vLLM's module names).

A family is known only when it has been checked against HF transformers (tests/core/test_points.py): a
guessed submodule would give a wrong tensor, and a wrong tensor is worse than a refusal. For a family
not in the table, `resid_pre` / `resid_post` still work (they need only the decoder-layer list) and the
inner points are refused up front, naming the model. Read by the frontend (which points a request may
ask for, from the HF config) and by the workers (which submodules to tap).

`attn` / `mlp`: the submodule whose *output* is what the attention / MLP block adds to the stream (after
the post-norm of sandwich-norm families). `z`: the attention's output projection (its *input* is the
heads' concatenated outputs). `mid`: the submodule whose *input* is the stream between the
two blocks (`resid_mid`; its `(hidden, residual)` pair in fused add-norm layouts); None when the layout
has no such stream (parallel residual) — `mid_missing` then says why. `mlp_in`: the submodule whose
*input* is what the MLP / MoE block reads (the pre-MLP norm's output, its weight applied): the MLP block
itself, or its first projection where the family has no MLP module (OPT).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_worker.protocol.points import (
    ATTN_OUT,
    INNER,
    MAX_MLP_CHUNKS,
    MLP_IN,
    MLP_OUT,
    MLP_POST,
    RESID_MID,
    ROUTER_LOGITS,
    K,
    Q,
    Z,
    mlp_chunks,
)


@dataclass(frozen=True)
class Layout:
    family: str
    attn: str
    mlp: str
    mid: str | None
    z: str | None  # None: the attention has no per-head output of the usual shape (MLA)
    mid_missing: str = ""
    router: str | None = None  # MoE: the router (gate) submodule, whose output is the router logits
    core: str | None = None  # vLLM's attention kernel module, called as (q, k, v) after the rotary embedding
    mlp_in: str | None = None  # the module called with the MLP block's input (after the pre-MLP norm)
    mlp_post: str | None = None  # the MLP's down projection, called with act(gate) * up / act(fc_in); None: MoE


# MoE families: the router module of a layer (a layer without it, e.g. a dense layer of a mixed model, has
# no router_logits)
_ROUTERS = {"mixtral": "block_sparse_moe.gate", "qwen3_moe": "mlp.gate", "deepseek_v2": "mlp.gate"}
# where q and k enter vLLM's attention; GPT-NeoX runs HF's attention (Transformers backend): not exposed
_CORES = {
    **dict.fromkeys(
        (
            "llama",
            "mistral",
            "qwen2",
            "qwen3",
            "phi3",
            "qwen3_moe",
            "mixtral",
            "gemma2",
            "gemma3",
            "gemma3_text",
            "opt",
        ),
        "self_attn.attn",
    ),
    "gpt2": "attn.attn",
}

# the module whose input is what the MLP block reads: the MLP itself, unless the table's `mlp` is a norm after
# it (sandwich norms) or its last projection (OPT has no MLP module: fc1 reads the normed stream)
_MLP_INS = {"gemma2": "mlp", "gemma3": "mlp", "gemma3_text": "mlp", "opt": "fc1"}
# the dense MLP's down projection, whose input is mlp_post (MoE families: none, each expert has its own)
_MLP_POSTS = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gemma3_text"), "mlp.down_proj"),
    "gpt2": "mlp.c_proj",
    "opt": "fc2",
    "gpt_neox": "mlp.dense_4h_to_h",
}


_SEQUENTIAL = ("self_attn", "mlp", "post_attention_layernorm", "self_attn.o_proj")
_SANDWICH = ("post_attention_layernorm", "post_feedforward_layernorm", "pre_feedforward_layernorm", "self_attn.o_proj")
_TABLE: dict[str, tuple[str, str, str | None, str | None]] = {
    "llama": _SEQUENTIAL,
    "mistral": _SEQUENTIAL,
    "qwen2": _SEQUENTIAL,
    "qwen3": _SEQUENTIAL,
    "phi3": _SEQUENTIAL,
    "qwen3_moe": _SEQUENTIAL,
    "mixtral": ("self_attn", "block_sparse_moe", "post_attention_layernorm", "self_attn.o_proj"),
    # sandwich norms: the stream receives the post-norm of each block's output
    "gemma2": _SANDWICH,
    "gemma3": _SANDWICH,
    "gemma3_text": _SANDWICH,
    "gpt2": ("attn", "mlp", "ln_2", "attn.c_proj"),
    "opt": ("self_attn", "fc2", "final_layer_norm", "self_attn.out_proj"),
    "gpt_neox": ("attention", "mlp", "post_attention_layernorm", "attention.dense"),
    # multi-head latent attention: no per-head z / q / k of the usual shape (refused, never a wrong tensor)
    "deepseek_v2": ("self_attn", "mlp", "post_attention_layernorm", None),
}


def text_config(hf_config: Any) -> Any:
    get = getattr(hf_config, "get_text_config", None)
    return get() if callable(get) else hf_config


def layout_for(hf_config: Any) -> Layout | None:
    """The layout of a served model from its HF config; None when the family is not in the table."""
    cfg = text_config(hf_config)
    family = str(getattr(cfg, "model_type", ""))
    entry = _TABLE.get(family)
    if entry is None:
        return None
    attn, mlp, mid, z = entry
    why = ""
    if family == "gpt_neox" and getattr(cfg, "use_parallel_residual", True):
        mid, why = (
            None,
            "GPTNeoX with use_parallel_residual=True (Pythia) is a parallel-residual layout: attention and MLP read the same input",
        )
    if family == "opt" and not getattr(cfg, "do_layer_norm_before", True):
        mid, why = None, "post-LayerNorm OPT normalises the stream between attention and MLP"
    return Layout(
        family,
        attn,
        mlp,
        mid,
        z,
        why + (", so there is no resid_mid" if why else ""),
        _ROUTERS.get(family),
        _CORES.get(family),
        _MLP_INS.get(family, mlp),
        _MLP_POSTS.get(family),
    )


def kv_heads(hf_config: Any) -> int:
    cfg = text_config(hf_config)
    n, _ = head_shape(hf_config)
    return int(getattr(cfg, "num_key_value_heads", None) or n)


def moe_shape(hf_config: Any) -> tuple[int, int]:
    """(n_experts, experts chosen per token) of an MoE model; (0, 0) for a dense one. k is 0 where the
    router does not choose the plain top-k of its logits (grouped or biased routing): no `expert_ids`."""
    cfg = text_config(hf_config)
    n = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 0
    n = n or getattr(cfg, "n_routed_experts", None) or 0
    k = getattr(cfg, "num_experts_per_tok", None) or 0
    if getattr(cfg, "topk_method", "greedy") != "greedy":
        k = 0
    return int(n), int(k)


def mlp_width(hf_config: Any) -> int:
    """d_mlp: the dense MLP's hidden width (GPT-2's n_inner defaults to 4 x d_model); 0 when unknown."""
    cfg = text_config(hf_config)
    for name in ("intermediate_size", "ffn_dim", "n_inner"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return v
    if str(getattr(cfg, "model_type", "")) == "gpt2":
        return 4 * int(getattr(cfg, "n_embd", 0) or 0)
    return 0


def head_shape(hf_config: Any) -> tuple[int, int]:
    """(n_heads, d_head) of the attention (query heads; GQA shares key/value heads between them)."""
    cfg = text_config(hf_config)
    n = int(getattr(cfg, "num_attention_heads", 0) or getattr(cfg, "n_head", 0) or 0)
    d = getattr(cfg, "head_dim", None) or (int(cfg.hidden_size) // n if n else 0)
    return n, int(d)


def model_class(hf_config: Any) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    return archs[0] if archs else type(hf_config).__name__


def missing_points(hf_config: Any) -> dict[str, str]:
    """Points the served engine lacks -> why (checked by the frontend before a request runs): what the
    model's layout has, and of that what `VLLM_LENS_POINTS` enabled."""
    from vllm_worker.protocol.points import enabled_inner, not_enabled

    out = _layout_missing(hf_config)
    on = enabled_inner()
    for p in INNER:
        if p not in out and p not in on:
            out[p] = not_enabled(p)
    return out


def _layout_missing(hf_config: Any) -> dict[str, str]:
    layout = layout_for(hf_config)
    if layout is None:
        cfg = text_config(hf_config)
        why = (
            f"the decoder-layer layout of {model_class(hf_config)} (model_type {getattr(cfg, 'model_type', '?')!r}) "
            f"is not known to inspect-lens (known: {', '.join(sorted(_TABLE))}); resid_pre and resid_post work "
            "on every model"
        )
        return {p: why for p in INNER}
    out = {} if layout.mid is not None else {RESID_MID: layout.mid_missing}
    n, d = head_shape(hf_config)
    width = int(getattr(text_config(hf_config), "hidden_size", 0))
    if layout.z is None:
        out[Z] = f"{model_class(hf_config)} uses multi-head latent attention: no per-head output of the usual shape"
    elif n * d != width:
        out[Z] = f"its heads are {n} x {d} = {n * d} wide, not d_model {width} (z needs n_heads * d_head = d_model)"
    if layout.z is None:  # multi-head latent attention (the table's one kind without z)
        out[Q] = out[K] = (
            f"{model_class(hf_config)} uses multi-head latent attention: no per-head q / k of the usual shape"
        )
    elif layout.core is None:
        why = f"{model_class(hf_config)} runs an attention whose queries and keys inspect-lens cannot reach"
        out[Q] = out[K] = why
    elif n * d > width or kv_heads(hf_config) * d > width:
        out[Q] = out[K] = f"its queries ({n} x {d}) do not fit a row of d_model {width}"
    n_experts, _ = moe_shape(hf_config)
    d_mlp = mlp_width(hf_config)
    if layout.router is not None:
        out[MLP_POST] = (
            f"{model_class(hf_config)} is a mixture-of-experts model: each expert has its own hidden activation"
        )
    elif layout.mlp_post is None or not d_mlp:
        out[MLP_POST] = f"the MLP of {model_class(hf_config)} is not known to inspect-lens"
    elif mlp_chunks(d_mlp, width) > MAX_MLP_CHUNKS:  # never a wrong width (rows travel in d_model pieces)
        out[MLP_POST] = f"d_mlp {d_mlp} is wider than {MAX_MLP_CHUNKS} x d_model {width}"
    if layout.router is None:
        out[ROUTER_LOGITS] = f"{model_class(hf_config)} is not a mixture-of-experts model known to inspect-lens"
    elif not 0 < n_experts <= width:
        out[ROUTER_LOGITS] = f"{n_experts} experts do not fit a row of d_model {width}"
    return out


def _get(layer: torch.nn.Module, name: str) -> torch.nn.Module | None:
    m: Any = layer
    for part in name.split("."):
        m = getattr(m, part, None)
    return m if isinstance(m, torch.nn.Module) else None


def inner_modules(layer: torch.nn.Module, layout: Layout) -> dict[str, torch.nn.Module]:
    """{point: submodule} of one decoder layer; `LensIncompatibleVLLM` if the layer lacks one (vLLM renamed
    it: the table needs updating)."""
    from vllm_worker.compat.version import LensIncompatibleVLLM

    want = {ATTN_OUT: layout.attn, MLP_OUT: layout.mlp}
    if layout.mlp_in is not None:
        want[MLP_IN] = layout.mlp_in
    if layout.mlp_post is not None:
        want[MLP_POST] = layout.mlp_post
    if layout.z is not None:
        want[Z] = layout.z
    if layout.mid is not None:
        want[RESID_MID] = layout.mid
    out = {}
    if layout.router is not None:
        router = _get(layer, layout.router)
        if router is not None:  # optional per layer (dense layers of mixed models have none)
            out[ROUTER_LOGITS] = router
    if layout.core is not None:
        core = _get(layer, layout.core)
        if core is None:
            raise LensIncompatibleVLLM(f"{type(layer).__name__} has no attention module {layout.core!r} (q, k)")
        out[Q] = core
    for point, name in want.items():
        m = _get(layer, name)
        if m is None:
            raise LensIncompatibleVLLM(
                f"{type(layer).__name__} has no submodule {name!r} (expected for {point} of the {layout.family} layout)"
            )
        out[point] = m
    return out


def module_output(output: Any) -> torch.Tensor:
    """The tensor a block adds to the stream: modules return it, `(out, bias)` (vLLM's linear layers) or
    `(out, attention weights)` (HF attention under vLLM's Transformers backend)."""
    from vllm_worker.compat.version import LensIncompatibleVLLM

    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        if len(output) == 2 and isinstance(output[1], torch.Tensor) and output[1].shape == output[0].shape:
            raise LensIncompatibleVLLM("block output is a pair of same-shaped tensors (an unfused residual?)")
        return output[0]
    raise LensIncompatibleVLLM(f"unexpected block output {type(output).__name__}")
