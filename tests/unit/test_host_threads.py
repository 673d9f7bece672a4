"""Per-request tensor work in one thread (protocol/host_threads): the pool is restored, and the copies and
validated rows are exactly those torch's pool gives."""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import BaseModel

from vllm_worker.api.steering import SteeringVector
from vllm_worker.frontend.validation import parse_request
from vllm_worker.protocol.host_threads import one_thread
from vllm_worker.protocol.spec import ModelShape

SHAPE = ModelShape(n_layers=4, d_model=40000)  # rows wide enough for torch to split over its pool


def _pool(n: int) -> None:
    torch._C.set_num_threads(n)  # (vLLM's in-process CPU worker replaces torch.set_num_threads)


@pytest.fixture()
def two_threads(resizable_pool: None) -> None:
    _pool(2)  # (the pool's size before comes back after the test: `resizable_pool`)


def test_one_thread_restores_the_pool_even_on_error(two_threads: None) -> None:
    with one_thread():
        assert torch.get_num_threads() == 1
        with one_thread():  # nested: still one, and the outer block's setting comes back
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), one_thread():
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2


def test_deepcopy_is_pydantic_copy_in_one_thread(two_threads: None) -> None:
    acts = torch.randn(4, SHAPE.d_model)
    sv = SteeringVector(activations=acts, layer_indices=[0, 1, 2, 3], op="ablate", phase="generated")
    ours, theirs = copy.deepcopy(sv), BaseModel.__deepcopy__(sv, {})
    assert torch.get_num_threads() == 2
    assert ours.activations is not acts and ours.activations.data_ptr() != acts.data_ptr()
    assert torch.equal(ours.activations, theirs.activations)
    assert ours.model_dump(exclude={"activations"}) == sv.model_dump(exclude={"activations"})


@pytest.mark.parametrize("op", ["add", "ablate", "cap", "set"])
def test_validated_rows_identical_and_not_the_callers(op: str, two_threads: None) -> None:
    acts = torch.randn(4, SHAPE.d_model, generator=torch.Generator().manual_seed(1))
    keep = acts.clone()
    kw = {"lo": -1.0, "hi": 1.0} if op == "cap" else {}
    sv = SteeringVector(activations=acts, layer_indices=[0, 1, 2, 3], op=op, **kw)
    pooled = parse_request({"apply_steering_vectors": [sv]}, SHAPE, 8).steers[0].vectors
    with one_thread():
        single = parse_request({"apply_steering_vectors": [sv]}, SHAPE, 8).steers[0].vectors
    assert torch.equal(pooled, single)  # bit-identical, whatever the thread count
    assert single.data_ptr() != acts.data_ptr()  # a copy of its own: the caller's tensor may change later
    acts.add_(1.0)
    assert torch.equal(single, pooled) and not torch.equal(acts, keep)


def test_bad_rows_still_named(two_threads: None) -> None:
    acts = torch.randn(4, SHAPE.d_model)
    acts[2, 5] = float("nan")
    sv = SteeringVector(activations=acts, layer_indices=[0, 1, 2, 3], op="ablate")
    with pytest.raises(ValueError, match=r"apply_steering_vectors\[0\]\.activations"), one_thread():
        parse_request({"apply_steering_vectors": [sv]}, SHAPE, 8)
    assert torch.get_num_threads() == 2


def test_deepcopy_keeps_autograd_and_shared_tensors() -> None:
    leaf = torch.randn(1, 8, requires_grad=True)
    sv = SteeringVector(activations=leaf, layer_indices=[0])
    out = copy.deepcopy(sv).activations
    assert out.requires_grad and out is not leaf and torch.equal(out.detach(), leaf.detach())
    shared = torch.randn(1, 8)
    pair = [
        SteeringVector(activations=shared, layer_indices=[0]),
        SteeringVector(activations=shared, layer_indices=[1]),
    ]
    a, b = copy.deepcopy(pair)  # one copy of a tensor the originals share, as copy.deepcopy gives
    assert a.activations is b.activations and a.activations is not shared
    view = torch.randn(3, 8)[1:2]
    v = copy.deepcopy(SteeringVector(activations=view, layer_indices=[0])).activations
    assert torch.equal(v, view) and v.data_ptr() != view.data_ptr()


def test_this_build_uses_openmp() -> None:
    """The guard only acts on OpenMP builds (the wheels vLLM runs on): fail loudly if that changes here."""
    from vllm_worker.protocol import host_threads

    assert host_threads._OPENMP


def test_left_alone_where_vllm_replaced_set_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-process CPU engine: vLLM's replacement warns and does nothing; we must not call it per request."""
    calls: list[int] = []

    def replaced(n: int) -> None:  # a Python function, as vLLM's `skip_set_num_threads`
        calls.append(n)

    monkeypatch.setattr(torch, "set_num_threads", replaced)
    with one_thread():
        pass
    assert calls == []


@pytest.mark.parametrize("op", ["ablate", "cap"])
def test_unit_directions_are_the_rows_over_their_norms_and_the_callers_stay(op: str) -> None:
    """ablate / cap rows: one norm pass (`check_directions` hands its norms back) and the division in the
    validated copy give exactly `acts / acts.norm(...)`; the caller's tensor is untouched; a zero row is
    refused naming the field."""
    acts = torch.randn(4, SHAPE.d_model, generator=torch.Generator().manual_seed(2)) * 3
    keep = acts.clone()
    kw = {"lo": -1.0, "hi": 1.0} if op == "cap" else {}
    sv = SteeringVector(activations=acts, layer_indices=[0, 1, 2, 3], op=op, **kw)
    with one_thread():
        got = parse_request({"apply_steering_vectors": [sv]}, SHAPE, 8).steers[0].vectors
        want = keep / keep.norm(dim=-1, keepdim=True)
    assert torch.equal(got, want) and torch.equal(acts, keep)
    zero = keep.clone()
    zero[1] = 0.0
    item = {"activations": zero, "layer_indices": [0, 1, 2, 3], "op": op, **kw}
    with pytest.raises(ValueError, match=r"apply_steering_vectors\[0\]\.activations: row \[1\] is zero"):
        parse_request({"apply_steering_vectors": [item]}, SHAPE, 8)
