"""`projection.project`'s device branch (`rowwise=False`, outside vLLM's batch-invariant mode) on CPU tensors:
several sites scored together into a view of a wider record, as `StagedProbes` does on a GPU, equal to the
float64 product within float32 rounding, each site with its own weights, the record's other columns
untouched; one site alike."""

from __future__ import annotations

import torch

from vllm_worker.worker.projection import project


def test_several_sites_at_once_into_a_record_view() -> None:
    g = torch.Generator().manual_seed(3)
    s, m, d, n = 4, 37, 512, 2
    x = torch.randn(s, m, d, generator=g).to(torch.bfloat16)  # staged rows are the model's dtype
    w = torch.randn(s, n, d, generator=g)
    rec = torch.full((s, m, n + 1), 7.0)
    project(x, w, rec[..., :n], rowwise=False)
    ref = torch.einsum("smd,snd->smn", x.double(), w.double())
    assert (rec[..., :n].double() - ref).abs().max() <= 1e-5 * float(ref.abs().max())
    assert bool((rec[..., n] == 7.0).all())
    one = torch.empty(m, n)
    project(x[2], w[2], one, rowwise=False)
    assert (one.double() - ref[2]).abs().max() <= 1e-5 * float(ref.abs().max())
