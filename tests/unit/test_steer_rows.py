"""The frontend's steering rows remembered by content (`frontend.steer_rows`): a request equal to a recent
one gets the same rows, wire bytes and salt as if validated afresh, its own copy of the rows, and nothing
the caller changes afterwards (or a different input with the same ends) can take remembered rows."""

import numpy as np
import pytest
import torch

from vllm_worker.api.steering import SteeringVector
from vllm_worker.frontend import steer_rows
from vllm_worker.frontend.validation import parse_request
from vllm_worker.protocol.checks import host_float32
from vllm_worker.protocol.recent import same_bytes
from vllm_worker.protocol.spec import ModelShape, cache_salt, decode, encode

D, L = 1024, 4
SHAPE = ModelShape(n_layers=L, d_model=D)


def _spec(acts, op="ablate", **kw):
    sv = SteeringVector(activations=acts, layer_indices=list(range(acts.shape[0])), op=op, **kw)
    spec = parse_request({"apply_steering_vectors": [sv]}, SHAPE, 10)
    assert spec is not None
    return spec


def _fresh(acts: torch.Tensor, op: str) -> torch.Tensor:
    """What validation computed before the memo: a float32 copy, unit rows for ablate / cap."""
    rows = host_float32(acts)
    return rows / rows.norm(dim=-1, keepdim=True) if op in ("ablate", "cap") else rows


@pytest.fixture(autouse=True)
def _empty_memo():
    steer_rows._memo.clear()
    yield
    steer_rows._memo.clear()


@pytest.mark.parametrize("op", ["add", "ablate"])
def test_equal_inputs_get_equal_bits_and_own_rows(op):
    v = torch.randn(L, D, generator=torch.Generator().manual_seed(0)) * 5
    a, b = _spec(v.clone(), op), _spec(v.clone(), op)  # the second is a memo hit
    assert len(steer_rows._memo) == 1
    want = _fresh(v, op).numpy().tobytes()
    for s in (a, b):
        payload = encode(s)
        assert payload["steer"][0]["vec"]["data"] == want  # the bits of validating afresh
        assert decode(payload).steers[0].vectors.numpy().tobytes() == want
    assert a.steers[0].vectors.data_ptr() != b.steers[0].vectors.data_ptr()  # each request's own rows
    a.steers[0].vectors.zero_()  # writing one request's rows changes nobody else's
    c = _spec(v.clone(), op)
    assert c.steers[0].vectors.numpy().tobytes() == want
    assert cache_salt(b) == cache_salt(c) and cache_salt(b) is not None


def test_caller_changing_its_tensor_gets_new_rows():
    v = torch.randn(L, D, generator=torch.Generator().manual_seed(1))
    first = encode(_spec(v, "add"))["steer"][0]["vec"]["data"]
    v[2, D // 2] += 1.0  # same ends (the key's edges), different middle
    second = _spec(v, "add")
    assert encode(second)["steer"][0]["vec"]["data"] == _fresh(v, "add").numpy().tobytes() != first
    assert cache_salt(second) != cache_salt(_spec(v.clone().index_fill_(1, torch.tensor([0]), 3.0), "add"))


def test_op_and_dtype_are_part_of_the_content():
    v = torch.randn(L, D, generator=torch.Generator().manual_seed(2))
    add, ablate = _spec(v, "add"), _spec(v, "ablate")
    assert not torch.equal(add.steers[0].vectors, ablate.steers[0].vectors)
    assert torch.equal(ablate.steers[0].vectors, _fresh(v, "ablate"))
    wide = _spec(v.double(), "ablate")  # other bytes: its own entry, rows of the float64 input
    assert torch.equal(wide.steers[0].vectors, _fresh(v.double(), "ablate"))
    assert len(steer_rows._memo) == 3


def test_expanded_view_and_bfloat16_validate_as_before():
    u = torch.randn(D, generator=torch.Generator().manual_seed(3))
    view = _spec(u.expand(L, D), "ablate")  # a strided view (a 1-D registered vector): compared as a copy
    assert torch.equal(view.steers[0].vectors, _fresh(u.expand(L, D).contiguous(), "ablate"))
    half = _spec(u.expand(L, D).bfloat16(), "add")  # not remembered: validated as before
    assert torch.equal(half.steers[0].vectors, host_float32(u.expand(L, D).bfloat16()))
    assert len(steer_rows._memo) == 1


def _dict_spec(acts, op):
    """As an HTTP caller sends it (a dict: checked by validation only, not by `SteeringVector`)."""
    return parse_request(
        {"apply_steering_vectors": [{"activations": acts, "layer_indices": list(range(L)), "op": op}]}, SHAPE, 10
    )


def test_failures_are_never_remembered_and_name_the_field():
    v = torch.randn(L, D, generator=torch.Generator().manual_seed(4))
    _spec(v, "ablate")
    bad = v.clone()
    bad[1] = 0.0
    for _ in range(2):
        with pytest.raises(ValueError, match=r"apply_steering_vectors\[0\]\.activations: row \[1\] is zero"):
            _dict_spec(bad, "ablate")
    nan = v.clone()
    nan[3, 7] = float("nan")
    for _ in range(2):
        with pytest.raises(ValueError, match=r"apply_steering_vectors\[0\]\.activations: contains NaN or inf"):
            _dict_spec(nan, "add")
    assert len(steer_rows._memo) == 1


def test_memo_is_bounded():
    for i in range(steer_rows.KEPT + 3):
        _spec(torch.full((L, D), float(i + 1)), "add")
    assert len(steer_rows._memo) == steer_rows.KEPT
    assert all(type(got[0]) is bytes for got in steer_rows._memo.values())  # a copy of the bytes, no tensor


def test_byte_comparison_is_exact_at_every_byte():
    """The memo's test (`recent.same_bytes`, one memcmp) agrees with numpy's element comparison: any single flipped bit in the
    first, a middle or the last byte, or a length that differs, is a miss."""
    src = torch.randn(L, D).numpy().reshape(-1).view(np.uint8)
    kept = src.tobytes()
    assert same_bytes(kept, src.data)
    for at in (0, src.nbytes // 2 + 1, src.nbytes - 1):
        other = src.copy()
        other[at] ^= 1
        assert not same_bytes(kept, other.data) and not np.array_equal(np.frombuffer(kept, np.uint8), other)
    assert not same_bytes(kept, src[:-4].data) and not same_bytes(kept[:-4], src.data)


@pytest.mark.parametrize("op", ["add", "ablate"])
def test_an_expanded_vector_is_decided_by_its_row_and_gets_the_dense_bits(op):
    """A registered vector arrives expanded over its layers (stride 0): the memo compares its one row, and its
    rows, wire bytes and digest are those of the same values as a dense tensor; a row one bit off misses."""
    v = torch.randn(D)
    dense = steer_rows.checked_rows(v.expand(L, D).clone(), op, "f")
    first = steer_rows.checked_rows(v.clone().expand(L, D), op, "f")
    again = steer_rows.checked_rows(v.clone().expand(L, D), op, "f")  # another object, same values: a hit
    assert len(steer_rows._memo) == 2  # the dense and the expanded forms, one entry each
    for got in (first, again):
        assert got.raw == dense.raw and got.digest == dense.digest and got.repeat == dense.repeat == L
        assert torch.equal(got.rows, dense.rows)  # (a hit's equal rows: its own row, expanded, never written)
    assert first.rows.data_ptr() != again.rows.data_ptr()  # each request its own rows
    assert torch.equal(first.rows, _fresh(v.expand(L, D), op))
    off = v.clone()
    off.view(torch.int32)[-1] ^= 1
    miss = steer_rows.checked_rows(off.expand(L, D), op, "f")
    assert miss.raw != dense.raw and torch.equal(miss.rows, _fresh(off.expand(L, D), op))
    assert len(steer_rows._memo) == 3
