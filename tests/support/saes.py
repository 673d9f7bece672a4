"""Tiny random SAEs over the tiny llama (d_model 128), in the form `vllm_worker.sae` loads and saves, and the
SAELens inference math written out again in plain torch (`ref_encode` / `ref_decode`, independent of
`Sae.encode`): the reference every SAE test compares the engine with."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm_worker.sae import Sae, save

D = 128


def random_sae(
    seed: int,
    point: str = "resid_post",
    layer: int = 2,
    arch: str = "standard",
    k: int = 0,
    d_sae: int = 256,
    normalize: str = "none",
    apply_b_dec_to_input: bool = True,
) -> Sae:
    g = torch.Generator().manual_seed(seed)
    W_enc = torch.randn(D, d_sae, generator=g) / D**0.5
    W_dec = torch.randn(d_sae, D, generator=g) / D**0.5
    b_enc = torch.randn(d_sae, generator=g) * 0.1 - 0.2
    b_dec = torch.randn(D, generator=g) * 0.05
    thr = torch.rand(d_sae, generator=g) * 0.5 if arch == "jumprelu" else None
    return Sae(point, layer, arch, W_enc, b_enc, W_dec, b_dec, thr, k, apply_b_dec_to_input, normalize)


def random_transcoder(seed: int, layer: int, arch: str = "standard", skip: bool = False, d_sae: int = 192, **kw) -> Sae:
    """A transcoder in SAELens's layout: encoder on mlp_in, decoder on mlp_out of `layer` (b_dec d_out wide,
    never subtracted from the input); `skip`: a skip transcoder's W_skip."""
    g = torch.Generator().manual_seed(seed)
    thr = torch.rand(d_sae, generator=g) * 0.3 if arch == "jumprelu" else None
    return Sae(
        "mlp_in",
        layer,
        arch,
        torch.randn(D, d_sae, generator=g) / D**0.5,
        torch.randn(d_sae, generator=g) * 0.1 - 0.1,
        torch.randn(d_sae, D, generator=g) / D**0.5,
        torch.randn(D, generator=g) * 0.05,
        thr,
        apply_b_dec_to_input=False,
        out_point="mlp_out",
        out_layer=layer,
        W_skip=torch.randn(D, D, generator=g) * 0.01 if skip else None,
        **kw,
    )


def save_with(sae: Sae, folder: Path, **cfg_fields) -> str:
    """`save`, then extra top-level cfg.json fields (e.g. `rescale_acts_by_decoder_norm`) the way SAELens
    writes them."""
    save(sae, folder)
    cfg_file = folder / "cfg.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(cfg_fields)
    cfg_file.write_text(json.dumps(cfg))
    return str(folder)


def _norm_in(s: Sae, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float, torch.Tensor | float]:
    """SAELens's run-time input normalisation: (x', scale, shift) with norm_out(y) = y * scale + shift."""
    if s.normalize == "constant_norm_rescale":
        c = D**0.5 / torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return x * c, 1 / c, 0.0
    if s.normalize == "layer_norm":
        mu = x.mean(-1, keepdim=True)
        std = torch.std(x - mu, dim=-1, keepdim=True, correction=1)
        return (x - mu) / (std + 1e-5), std, mu
    assert s.normalize == "none", s.normalize
    return x, 1.0, 0.0


def ref_encode(s: Sae, x: torch.Tensor, rescale: bool = False) -> torch.Tensor:
    """Features of rows `x` (float32); `rescale`: a TopK SAE with `rescale_acts_by_decoder_norm`."""
    xn, _, _ = _norm_in(s, x.float())
    if s.apply_b_dec_to_input:
        xn = xn - s.b_dec
    pre = xn @ s.W_enc + s.b_enc
    if rescale:
        pre = pre * s.W_dec.norm(dim=-1)
    if s.architecture == "jumprelu":
        return torch.where(pre > s.threshold, pre.clamp(min=0), torch.zeros_like(pre))
    if s.architecture == "topk":
        v, i = pre.topk(s.k, dim=-1)
        return torch.zeros_like(pre).scatter(-1, i, v.clamp(min=0))
    return pre.clamp(min=0)


def ref_decode(s: Sae, f: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The reconstruction of features `f` of rows `x` (the normalisation undone with x's statistics)."""
    _, scale, shift = _norm_in(s, x.float())
    return (f @ s.W_dec + s.b_dec) * scale + shift


def ref_clamp(s: Sae, x: torch.Tensor, ids: list[int], values: list[float]) -> torch.Tensor:
    """x + decode(f with f[ids] = values) - decode(f): the SAE's error term kept."""
    f = ref_encode(s, x)
    g = f.clone()
    g[:, ids] = torch.tensor(values)
    return x + ref_decode(s, g, x) - ref_decode(s, f, x)


def worker_sae_counts(worker) -> dict[str, int]:
    """Run in a worker (`llm.collective_rpc(worker_sae_counts)`): the rows it encoded and clamped so far."""
    from vllm_worker.counters import SAE_COUNTS

    return dict(SAE_COUNTS)
