"""What every request's inputs cost on the thread that feeds the engine: the plugin checks and copies every
vector it is sent (numpy, one pass on that thread), and the worker keys shared entries by a digest."""

from __future__ import annotations

import pytest
import torch

from vllm_worker.protocol.checks import all_finite
from vllm_worker.worker.graph_entries import digest


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_all_finite_finds_nan_and_inf_anywhere(dtype):
    t = torch.zeros(3, 70_000, dtype=dtype)
    assert all_finite(t) and all_finite(t[:, ::7]) and all_finite(torch.zeros(0, dtype=dtype))
    for bad in (float("nan"), float("inf"), float("-inf")):
        u = t.clone()
        u[2, 69_999] = bad
        assert not all_finite(u), (dtype, bad)
        assert not all_finite(u.T), (dtype, bad)  # not contiguous


def test_the_content_digest_tells_dtype_shape_and_every_byte_apart():
    a = torch.randn(32, 512)
    assert digest(a) == digest(a.clone()) and len(digest(a)) == 16
    assert digest(a) != digest(a.reshape(512, 32)) and digest(a) != digest(a.double())
    b = a.clone()
    b.view(torch.int32)[31, 511] ^= 1  # one bit of the last value
    assert digest(a) != digest(b)
    assert digest(a.T) == digest(a.T.contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_host_float32_is_an_exact_float32_copy_of_its_own(dtype):
    from vllm_worker.protocol.checks import host_float32

    t = torch.randn(32, 4096, dtype=torch.float64).to(dtype)
    for src in (t, t.T, t.expand(2, 32, 4096)[1], t[:, ::3]):
        before = src.clone()
        got = host_float32(src)
        assert got.dtype == torch.float32 and got.is_contiguous() and torch.equal(got, src.to(torch.float32))
        got.add_(1.0)  # its own memory: the caller's tensor is untouched
        assert torch.equal(src, before)
