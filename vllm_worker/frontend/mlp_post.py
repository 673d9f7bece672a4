"""`mlp_post` in the frontend: the MLP's d_mlp-wide hidden activation travels as `ModelShape.mlp_chunks`
d_model-wide pieces, each a site of its own (`protocol.points.point_sites`), so every buffer on the way
(staging ring, store, result pool) keeps rows of d_model. Steering vectors are cut into those pieces
before they leave the frontend (edits of the whole row stay whole), and captures are put back together
when they arrive."""

from __future__ import annotations

from dataclasses import replace

import torch

from vllm_worker.protocol import ops
from vllm_worker.protocol import points as pts
from vllm_worker.protocol.spec import ModelShape, Steer

# operations that act on each value alone survive the cut; ones that read the whole row (a projection on a
# direction, a norm) stay whole at the tap's own site: the worker steers the whole row there (graph path:
# `interventions.WHOLE` chains; under TP, the Python path)
_PER_VALUE_OPS = (ops.ADD, ops.SET)


def _is_mlp_post(st: Steer) -> bool:
    return bool(st.layers) and all(pts.split_site(s)[1] == pts.MLPPOST for s in st.layers)


def _reads_row(st: Steer) -> bool:
    return st.op not in _PER_VALUE_OPS or st.norm_match


def split_steers(steers: list[Steer], shape: ModelShape, field: str) -> list[Steer]:
    """Each steer at mlp_post (vectors d_mlp wide) as one steer per d_model-wide piece (the last padded) —
    unless the request also edits the whole row there (ablate, cap, norm_match): then all its mlp_post
    steers stay whole at the tap's site, so they still apply in the order given (`worker.interventions`)."""
    at = [_is_mlp_post(st) for st in steers]
    if not any(at):  # (no steer at mlp_post: nothing to cut)
        return list(steers)
    for i, st in enumerate(steers):
        if at[i] and st.mul:
            raise ValueError(f"{field}[{i}]: at point 'mlp_post' a multiplication is not supported")
    if any(_is_mlp_post(st) and _reads_row(st) for st in steers):
        return list(steers)
    out: list[Steer] = []
    for st in steers:
        if not _is_mlp_post(st):
            out.append(st)
            continue
        d, n = shape.d_model, shape.mlp_chunks
        v = torch.nn.functional.pad(st.vectors, (0, n * d - st.vectors.shape[-1]))
        for j in range(n):
            sites = [pts.mlp_piece_sites(pts.site_layer(s), n)[j] for s in st.layers]
            piece = v[..., j * d : (j + 1) * d].contiguous()  # (new rows: not the whole row's bytes / digest)
            out.append(replace(st, layers=sites, vectors=piece, raw=None, digest=None, repeat=0))
    return out


def assemble(t: torch.Tensor, n_layers: int, shape: ModelShape) -> torch.Tensor:
    """Captured pieces `(n_layers * chunks, n_pos, d_model)` (each layer's pieces in order) as
    `(n_layers, n_pos, d_mlp)`."""
    n = shape.mlp_chunks
    return t.unflatten(0, (n_layers, n)).permute(0, 2, 1, 3).flatten(-2)[..., : shape.d_mlp]
