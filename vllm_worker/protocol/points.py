"""Hook points: the names callers use (TransformerLens's vocabulary) and the tap sites they map to.

A site is one tap op call inside the model, `site = layer * SITES_PER_LAYER + code`. Codes: the stream
entering a layer (`resid_pre`; a tap only on the first layer of a stage), leaving it (`resid_post`), the
attention block's output added to the stream (`attn_out`), the stream between attention and MLP
(`resid_mid`; sequential layouts only), what the MLP / MoE block receives (`mlp_in`: after its pre-MLP
norm, the norm's weight applied) and the MLP / MoE block's output added to the stream (`mlp_out`).
`z` is per head: each head's attention output before the output projection (the input of `o_proj`), one
row of `n_heads * d_head` values per token (`(n_heads, d_head)` once handed back). `router_logits` (MoE layers): the router's logit per expert and
token, carried in rows of d_model (the first n_experts values) and handed back `(n_experts,)` wide, with
`expert_ids` (the top-k experts chosen) beside them. `q` / `k`: queries and keys after the rotary embedding,
as the attention kernel receives them (`(n_heads, d_head)` / `(n_kv_heads, d_head)` per token). `resid_pre` of layer i > 0 *is* `resid_post` of layer i - 1 (same tensor, before layer i reads it), so
captures and steering there use that site (`canonical_site`); hooks keep the layer index they asked for.
Exact definitions per family: docs/hook-points.md.
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable

RESID_PRE, RESID_POST, ATTN_OUT, RESID_MID, MLP_OUT = "resid_pre", "resid_post", "attn_out", "resid_mid", "mlp_out"
Z = "z"
MLP_IN = "mlp_in"
# the MLP's hidden activation entering its down projection (TransformerLens `mlp.hook_post`), d_mlp wide:
# captured and steered as `mlp_chunks` consecutive sites of d_model-wide pieces (codes MLP_PIECES..), so
# every buffer downstream (staging ring, store, result pool) keeps rows of d_model; hooks see the whole row
# at the tap's own site (code MLPPOST)
MLP_POST = "mlp_post"
ROUTER_LOGITS = "router_logits"
Q, K = "q", "k"
# in the order of a layer's computation (the order of `activations` keys and of docs)
POINTS = (RESID_PRE, Q, K, Z, ATTN_OUT, RESID_MID, MLP_IN, ROUTER_LOGITS, MLP_POST, MLP_OUT, RESID_POST)
# inner points: need the model's layout (which submodule is attention, which the MLP)
INNER = (Q, K, Z, ATTN_OUT, RESID_MID, MLP_IN, ROUTER_LOGITS, MLP_POST, MLP_OUT)
# read-only: captured and hooked, never steered (their width is not d_model)
NOT_STEERABLE = (Q, K, ROUTER_LOGITS)
# hooks there may read, not replace (views into vLLM's fused qkv buffer)
READ_ONLY = (Q, K)
IN, OUT, ATTN, MID, MLP, ZC, ROUTER, QC, KC, MLPIN, MLPPOST = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10
CODE = {
    RESID_PRE: IN,
    RESID_POST: OUT,
    ATTN_OUT: ATTN,
    RESID_MID: MID,
    MLP_OUT: MLP,
    Z: ZC,
    ROUTER_LOGITS: ROUTER,
    Q: QC,
    K: KC,
    MLP_IN: MLPIN,
    MLP_POST: MLPPOST,
}
NAME = {c: p for p, c in CODE.items()}
# A layer's codes: 0..MLP_PIECES-1 for points with one site each (11 used: room for 5 more), then
# mlp_post's pieces up to the end. Changing any of these changes every site id (and the compiled graphs,
# which hold them: `plugin.bootstrap._compile_marker`); tests/unit/test_site_layout.py pins them.
SITES_PER_LAYER = 32
MLP_PIECES = 16
MAX_MLP_CHUNKS = SITES_PER_LAYER - MLP_PIECES  # d_mlp up to 16 x d_model (codes 16..31)


def mlp_chunks(d_mlp: int, d_model: int) -> int:
    """d_model-wide pieces of an mlp_post row (the last one may be narrower)."""
    return max(1, -(-d_mlp // d_model)) if d_model else 1


def mlp_piece_sites(layer: int, chunks: int) -> list[int]:
    """The sites of the d_model-wide pieces of `layer`'s mlp_post row, in column order."""
    return [site(layer, MLP_PIECES + j) for j in range(chunks)]


def point_sites(point: str, layer: int, chunks: int = 1) -> list[int]:
    """Every site a capture or steering of `point` at `layer` uses: one, or mlp_post's `chunks` pieces."""
    if point == MLP_POST:
        return mlp_piece_sites(layer, chunks)
    return [canonical_site(point, layer)]


def site(layer: int, code: int) -> int:
    return layer * SITES_PER_LAYER + code


def split_site(s: int) -> tuple[int, int]:
    return divmod(s, SITES_PER_LAYER)


def site_layer(s: int) -> int:
    return s // SITES_PER_LAYER


def site_point(s: int) -> str:
    """The point a site belongs to (every piece of an mlp_post row is mlp_post)."""
    code = split_site(s)[1]
    return MLP_POST if code >= MLP_PIECES else NAME[code]


def describe(s: int) -> str:
    layer, code = split_site(s)
    if code >= MLP_PIECES:
        return f"{MLP_POST}[{layer}] piece {code - MLP_PIECES}"
    return f"{NAME.get(code, code)}[{layer}]"


def canonical_site(point: str, layer: int) -> int:
    """The site where `point` of `layer` is read and edited (captures, steering)."""
    if point == RESID_PRE and layer > 0:
        return site(layer - 1, OUT)
    return site(layer, CODE[point])


def canonical_sites(point: str, layers: list[int]) -> list[int]:
    """`[canonical_site(point, l) for l in layers]` in one pass (a request steering every layer)."""
    if point == RESID_PRE:
        return [canonical_site(point, layer) for layer in layers]
    code = CODE[point]
    return [layer * SITES_PER_LAYER + code for layer in layers]


POINTS_ENV = "VLLM_LENS_POINTS"


def enabled_inner() -> frozenset[str]:
    """The inner points this engine taps (`VLLM_LENS_POINTS`, read when the engine starts)."""
    from vllm_worker import envs

    raw = str(envs.get(POINTS_ENV) or "").strip()
    if not raw:
        return frozenset()
    if raw == "all":
        return frozenset(INNER)
    names = [n.strip() for n in raw.split(",") if n.strip()]
    for n in names:
        if n not in INNER:
            hint = closest(n, INNER)
            raise ValueError(
                f"{POINTS_ENV}: unknown inner hook point {n!r}{hint}; inner points: all, {', '.join(INNER)}"
            )
    return frozenset(names)


def not_enabled(point: str) -> str:
    return (
        f"inner hook points are tapped only when the engine starts with {POINTS_ENV}=all (or a list including "
        f"{point!r}; `vllm-lens serve --lens-points all`, `-M lens_points=all`)"
    )


def closest(name: str, valid: Iterable[str]) -> str:
    """' (did you mean X?)' for a misspelt name, else ''."""
    got = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    return f" (did you mean {got[0]!r}?)" if got else ""


def point_name(value: Any, field_name: str) -> str:
    if not isinstance(value, str) or value not in CODE:
        hint = closest(value, POINTS) if isinstance(value, str) else ""
        raise ValueError(f"{field_name}: unknown hook point {value!r}{hint}; points: {', '.join(POINTS)}")
    return value


def check_available(point: str, field_name: str, missing: dict[str, str]) -> None:
    """`missing`: point -> why the served model lacks it (`ModelShape.missing`)."""
    why = missing.get(point)
    if why is not None:
        raise ValueError(f"{field_name}: point {point!r} is not available on this model: {why}")
