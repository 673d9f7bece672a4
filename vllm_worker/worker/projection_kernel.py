"""The probe projection of a CUDA step as one Triton kernel: `out[s, m, n] = sum_d x[s, m, d] * w[s, n, d]`
with the staged rows `x` read in their own dtype (bf16 / fp16, converted in registers) and the weights and
sums in float32 — instead of a float32 copy of the rows, a cuBLAS batched matmul and a transposing copy.
Each program takes `BM` rows of one site and every column: a probe site has few columns (one per probe
output), so the products are summed over d in registers, `BK` at a time. Imported by `projection` only
where Triton is; run by Triton's interpreter in the tests."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["m", "n", "sx_s", "so_s"])  # (row counts vary batch to batch: one compile)
def project_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    m,
    n,
    d,
    sx_s,
    sx_m,
    sw_s,
    sw_n,
    so_s,
    so_m,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    s = tl.program_id(0)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    cols = tl.arange(0, BN)
    ks = tl.arange(0, BK)
    row_ok = rows < m
    col_ok = cols < n
    xb = x_ptr + s.to(tl.int64) * sx_s + rows.to(tl.int64)[:, None] * sx_m
    wb = w_ptr + s.to(tl.int64) * sw_s + cols.to(tl.int64)[:, None] * sw_n
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, d, BK):
        k_ok = (k0 + ks) < d
        xv = tl.load(xb + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        wv = tl.load(wb + (k0 + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(xv[:, None, :] * wv[None, :, :], axis=2)
    ob = out_ptr + s.to(tl.int64) * so_s + rows.to(tl.int64)[:, None] * so_m + cols[None, :]
    tl.store(ob, acc, mask=row_ok[:, None] & col_ok[None, :])
