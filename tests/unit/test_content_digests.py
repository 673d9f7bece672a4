"""`content_digests.RecentDigests`: a payload's vector digest is reused only for byte-equal payloads (an
exact comparison, so a vector differing anywhere — even between equal first and last bytes — gets its own
digest, the one `graph_entries.digest` gives), the memo is bounded, and anything that is not a payload's
`bytes` is hashed as before."""

from __future__ import annotations

import pytest
import torch

from vllm_worker.protocol.wire import tensor_from_bytes, tensor_to_bytes
from vllm_worker.worker import content_digests
from vllm_worker.worker.content_digests import RecentDigests
from vllm_worker.worker.graph_entries import digest


def _sent(t: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    obj = tensor_to_bytes(t)
    return obj["data"], tensor_from_bytes(obj, view=True)


def test_equal_bytes_share_a_digest_and_any_other_byte_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = content_digests.digest
    monkeypatch.setattr(content_digests, "digest", lambda t: calls.append(1) or real(t))
    memo = RecentDigests()
    v = torch.randn(32, 4096, generator=torch.Generator().manual_seed(0))
    first = memo.of(*_sent(v))
    again = memo.of(*_sent(v.clone()))  # other bytes objects, equal content
    assert first == again == digest(v) and len(calls) == 1
    w = v.clone()
    w[16, 2000] = torch.nextafter(w[16, 2000], torch.tensor(10.0))  # the middle: edges equal
    other = memo.of(*_sent(w))
    assert other == digest(w) != first and len(calls) == 2
    as_bf16 = v.to(torch.bfloat16)
    assert memo.of(*_sent(as_bf16)) == digest(as_bf16)  # (dtype and shape are part of the content)
    assert memo.of(*_sent(v.reshape(64, 2048))) == digest(v.reshape(64, 2048)) != first


def test_bounded_and_other_forms_hashed_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(content_digests, "KEPT", 3)
    memo = RecentDigests()
    for seed in range(10):
        t = torch.randn(2, 4096, generator=torch.Generator().manual_seed(seed))
        assert memo.of(*_sent(t)) == digest(t)
        assert len(memo._memo) <= 3
    small = torch.randn(1, 8)
    raw, t = _sent(small)
    assert memo.of(raw, t) == digest(small) and len(memo._memo) == 3  # (too small to keep)
    big = torch.randn(1, 4096)
    raw, t = _sent(big)
    assert memo.of(memoryview(raw), t) == digest(big) and memo.of(None, t) == digest(big)
