"""Tiny random SAEs over the tiny llama (d_model 128), in the form `vllm_worker.sae` loads and saves."""

from __future__ import annotations

import torch

from vllm_worker.sae import Sae

D = 128


def random_sae(
    seed: int, point: str = "resid_post", layer: int = 2, arch: str = "standard", k: int = 0, d_sae: int = 256
) -> Sae:
    g = torch.Generator().manual_seed(seed)
    W_enc = torch.randn(D, d_sae, generator=g) / D**0.5
    W_dec = torch.randn(d_sae, D, generator=g) / D**0.5
    b_enc = torch.randn(d_sae, generator=g) * 0.1 - 0.2
    b_dec = torch.randn(D, generator=g) * 0.05
    thr = torch.rand(d_sae, generator=g) * 0.5 if arch == "jumprelu" else None
    return Sae(point, layer, arch, W_enc, b_enc, W_dec, b_dec, thr, k)
