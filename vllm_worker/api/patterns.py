"""Attention patterns rebuilt from captured queries and keys (offline, no engine needed): the `q` / `k` hook
points give what the attention kernel received, so the pattern of any head follows without vLLM ever
materialising a `(heads, positions, positions)` tensor for every request."""

from __future__ import annotations

from typing import Sequence

import torch


def attention_pattern(
    q: torch.Tensor,
    k: torch.Tensor,
    heads: Sequence[int] | None = None,
    query_positions: Sequence[int] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`softmax(q kᵀ · scale + causal mask)` of one layer: `(len(heads), n_query, n_pos)`, float32.

    `q`: `activations["q"][i]`, `(n_pos, n_heads, d_head)`; `k`: `activations["k"][i]`, `(n_pos, n_kv_heads,
    d_head)` (a capture covers positions 0..n_pos-1 in order). Grouped-query attention: query head `h`
    reads key head `h // (n_heads // n_kv_heads)`. `scale` defaults to `d_head ** -0.5`; `softcap`
    (Gemma 2: `attn_logit_softcapping`) applies `softcap * tanh(scores / softcap)`; `sliding_window` masks
    keys more than that many positions back (as the model's config says, e.g. Mistral's or Gemma's local
    layers)."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q / k: expected (n_pos, n_heads, d_head) and (n_pos, n_kv_heads, d_head), got {tuple(q.shape)} / {tuple(k.shape)}"
        )
    n_pos, n_heads, d_head = q.shape
    n_kv = k.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"q / k: {n_heads} query heads are not a multiple of {n_kv} key heads")
    heads = list(range(n_heads)) if heads is None else [int(h) for h in heads]
    rows = list(range(n_pos)) if query_positions is None else [int(p) for p in query_positions]
    for h in heads:
        if not 0 <= h < n_heads:
            raise ValueError(f"heads: head {h} is out of range for {n_heads} heads")
    for p in rows:
        if not 0 <= p < n_pos:
            raise ValueError(f"query_positions: position {p} is outside the capture (0..{n_pos - 1})")
    group = n_heads // n_kv
    qh = q[rows][:, heads].float().transpose(0, 1)  # (H', n_q, d)
    kh = k[:, [h // group for h in heads]].float().transpose(0, 1)  # (H', n_pos, d)
    scores = qh @ kh.transpose(1, 2) * (d_head**-0.5 if scale is None else scale)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    qpos = torch.tensor(rows).unsqueeze(1)
    kpos = torch.arange(n_pos).unsqueeze(0)
    masked = kpos > qpos
    if sliding_window:
        masked |= kpos <= qpos - sliding_window
    return scores.masked_fill(masked, float("-inf")).softmax(-1)
