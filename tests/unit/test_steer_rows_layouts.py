"""Review of the steer_rows memo (front12): every tensor layout that reaches it — expanded rows of a strided
row, a 3-D tensor with stride 0 in dim 0, float64, transposed / sliced views, dense twins of expanded ones —
gets the bits validation makes afresh, never another input's remembered rows; the caller changing its tensor
afterwards changes neither the rows it got nor what a later equal input gets."""

import pytest
import torch

from vllm_worker.frontend import steer_rows

D, L = 1024, 4


@pytest.fixture(autouse=True)
def _empty_memo():
    steer_rows._memo.clear()
    yield
    steer_rows._memo.clear()


def _fresh(acts: torch.Tensor, op: str) -> steer_rows.Rows:
    """What the memo's miss computes, with no memo at all."""
    return steer_rows._make(acts, op, "f")


def _layouts(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    base = torch.randn(2 * L, 2 * D, generator=g, dtype=torch.float64).to(dtype)
    row = base[0, ::2]  # a non-contiguous row (stride 2)
    cube = torch.randn(L, 8, D // 8, generator=g, dtype=torch.float64).to(dtype)
    return [
        row.expand(L, D),  # stride (0, 2)
        row.contiguous().expand(L, D),  # stride (0, 1)
        row.expand(L, D).contiguous(),  # its dense twin
        base[:L, ::2],  # strided rows
        base[::2, :D],  # every other row
        base[:L, :D].T.contiguous().T,  # transposed storage
        cube[0].expand(L, 8, D // 8),  # 3-D, stride 0 in dim 0
        cube[0].T.expand(L, D // 8, 8),  # 3-D, stride 0 in dim 0, a transposed row
        cube,  # 3-D dense
        base[1, ::2].expand(L, D),  # another row, same layout as the first
        row.expand(2 * L, D)[::2],  # stride (0, 2) from a slice of an expanded tensor
    ]


@pytest.mark.parametrize("op", ["add", "ablate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_layout_gets_the_bits_of_a_fresh_validation(op, dtype):
    ins = _layouts(dtype)
    want = [_fresh(t, op) for t in ins]
    for rnd in range(3):  # misses, then hits (each input's own entry or a twin's)
        for t, w in zip(ins, want):
            got = steer_rows.checked_rows(t, op, "f")
            assert got.raw == w.raw and got.digest == w.digest and torch.equal(got.rows, w.rows)
            assert got.rows.dtype == torch.float32 and got.rows.shape == t.shape
            # dense rows, or rows all equal sent once (`repeat`): the request's own row, expanded (rowrep)
            assert got.rows.is_contiguous() or (got.repeat and got.rows.stride(0) == 0 and got.rows[0].is_contiguous())
    assert len({w.raw for w in want}) == len(ins) - 3  # only the first row's four forms share content


def test_an_expanded_row_one_bit_off_in_any_element_misses():
    """Stride 0 decides by row 0: a different row 0 — at its first, middle or last element — is a miss."""
    v = torch.randn(D, dtype=torch.float64)
    first = steer_rows.checked_rows(v.expand(L, D), "add", "f")
    for at in (0, D // 2, D - 1):
        off = v.clone()
        off.view(torch.int64)[at] ^= 1
        got = steer_rows.checked_rows(off.expand(L, D), "add", "f")
        assert got.raw == _fresh(off.expand(L, D), "add").raw
        assert got.raw != first.raw or off.to(torch.float32)[at] == v.to(torch.float32)[at]


def test_the_callers_later_writes_reach_neither_its_rows_nor_the_memo():
    v = torch.randn(D)
    t = v.clone().expand(L, D)
    got = steer_rows.checked_rows(t, "ablate", "f")  # a miss: rows from `_make`
    keep = got.rows.clone()
    base = t._base  # (an expanded tensor refuses in-place writes: the caller writes its storage)
    assert base is not None and base.ndim == 1
    base.mul_(3.0)
    assert torch.equal(got.rows, keep)
    again = steer_rows.checked_rows(v.clone().expand(L, D), "ablate", "f")  # the original values: a hit
    assert again.raw == got.raw and torch.equal(again.rows, keep)
    assert again.rows.data_ptr() != got.rows.data_ptr()
    again.rows.select(0, 0).mul_(0)  # a request writing its rows (its own one row: equal rows come expanded)
    third = steer_rows.checked_rows(v.clone().expand(L, D), "ablate", "f")
    assert torch.equal(third.rows, keep)
    changed = steer_rows.checked_rows(t, "ablate", "f")  # the caller's tensor, now changed: not a hit
    assert changed.raw == _fresh(t, "ablate").raw and changed.raw != got.raw
