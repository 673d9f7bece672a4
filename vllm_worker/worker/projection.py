"""The probe projection `x @ W.T` of a step's rows, one site or several at once, in float32 — on CPU with a
result per row that does not depend on the other rows (bit for bit), so that a request's scores do not
change with the batch around it.

A matmul's row can change in its last bits with how many rows run with it (the BLAS library picks its
blocking and threading by size). On CPU each score is instead an elementwise product and one `torch.sum`
over d: the sum reduces a contiguous last dimension with one thread per output, in an order set only by d
(and the machine's vector width). On CUDA it stays `torch.mm` / `torch.bmm`: vLLM's own GPU activations
depend on the batch there unless its batch-invariant mode is on, and cuBLAS's row may depend on the row
count too (docs/probes.md; bench/probes/row_invariance.py measures both on a lent GPU). With that mode on
(`VLLM_BATCH_INVARIANT=1`; the worker says so once: `use_batch_invariant`) a GPU score is a product, `mean`
over d and times d instead: the mode replaces `mean.dim` with a kernel that sums each output alone, in
float32, in a fixed order (not its matmuls: on Hopper `mm` stays cuBLAS, its `bmm` is TF32; docs/decisions.md).
"""

from __future__ import annotations

import torch

_CHUNK = 1 << 18  # product elements a chunk of rows holds at most (1 MiB of float32)
_MODE_CHUNK = 1 << 24  # the same under vLLM's batch-invariant mode (64 MiB: one chunk a decode step)
_BATCH_INVARIANT = False  # vLLM's batch-invariant mode is on in this process (`use_batch_invariant`)


def use_batch_invariant(on: bool) -> None:
    """Whether GPU projections go through the ops vLLM's batch-invariant mode replaces: set once by the
    worker (`compat.batch_invariant_mode()`, read after vLLM turned the mode on), not read per step."""
    global _BATCH_INVARIANT
    _BATCH_INVARIANT = on


def weight_views(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The views of `w` that `project` works on (transposed for one site's matmul, a broadcast dimension for
    the product; several sites' device branch reads `w` itself), made once by a caller projecting on the same
    weights every step: no view op a step."""
    return (w.T if w.dim() == 2 else w.transpose(1, 2)), w.unsqueeze(-3)


def project(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    rowwise: bool | None = None,
    views: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """`out = x @ w.T` in float32, for one site (x (m, d), w (n, d), out (m, n)) or several
    (x (s, m, d), w (s, n, d), out (s, m, n)). `rowwise` (default: on CPU): each row's result independent
    of the other rows, computed in chunks of rows (bounded temporary memory); else one matmul, or under
    vLLM's batch-invariant mode `_project_mode`. `views`: `weight_views(w)`, kept by the caller."""
    if rowwise is None:
        rowwise = x.device.type == "cpu"
    if not rowwise:
        if x.dtype != torch.float32:
            x = x.to(torch.float32)
        if _BATCH_INVARIANT:
            _project_mode(x, w, out)
        elif x.dim() == 2:
            torch.mm(x, w.T if views is None else views[0], out=out)
        else:  # as (s, n, m), then into `out`: cuBLAS's batched x @ w.T with a few outputs a site is
            # several times slower on the device than w @ x.T (docs/decisions.md, "seventeenth session")
            out.copy_(torch.bmm(w, x.transpose(1, 2)).transpose(1, 2))
        return
    if x.dtype == torch.float64:
        x = x.to(torch.float32)
    m, d, n = x.shape[-2], x.shape[-1], w.shape[-2]
    per_row = n * d * (1 if x.dim() == 2 else x.shape[0])
    wb = w.unsqueeze(-3) if views is None else views[1]  # (1, n, d) or (s, 1, n, d)
    step = max(1, _CHUNK // per_row)
    if m <= step and m * per_row > d:  # one chunk (a step's decode rows, mostly)
        torch.sum(x.unsqueeze(-2) * wb, dim=-1, out=out)
        return
    for r0 in range(0, m, step):
        k = min(step, m - r0)
        prod = x.narrow(-2, r0, k).unsqueeze(-2) * wb  # ([s,] rows, n, d) float32 (a bf16 x cast exactly)
        if k * per_row == d:
            # one output: torch.sum would split a long reduction across threads (another order); two
            # outputs (the same row twice) keep it one thread's
            out.narrow(-2, r0, k).copy_(prod.reshape(1, d).expand(2, d).sum(-1)[:1])
        else:
            torch.sum(prod, dim=-1, out=out.narrow(-2, r0, k))


def _project_mode(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """`project`'s GPU path under vLLM's batch-invariant mode, through ops it replaces (any device: the
    tests run it on CPU): an elementwise product, `mean` over d (aten::mean.dim) and times d — exactly the
    sum when d is a power of two, else within a rounding of it — in chunks of rows (bounded memory)."""
    m, d, n = x.shape[-2], x.shape[-1], w.shape[-2]
    step = max(1, _MODE_CHUNK // (n * d * (1 if x.dim() == 2 else x.shape[0])))
    wb = w.unsqueeze(-3)  # (1, n, d) or (s, 1, n, d)
    for r0 in range(0, m, step):
        k = min(step, m - r0)
        prod = x.narrow(-2, r0, k).unsqueeze(-2) * wb  # ([s,] rows, n, d)
        out.narrow(-2, r0, k).copy_(prod.mean(-1).mul_(d))


def _rowdot_mode(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`rowdot` under vLLM's batch-invariant mode (as `_project_mode`: a product, `mean` over d, times d)."""
    return (x * w).mean(-1).mul_(x.shape[-1])


def rowdot(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per row `x[i] . w[i]` in float32 (x, w (m, d)): probe actions' scores, one per (action, row) pair —
    `torch.linalg.vecdot`, a product and one sum over d per row; on CPU a single row is summed as two
    (torch.sum splits one output's long reduction across threads), so that it is the same row among others.
    On a GPU under vLLM's batch-invariant mode: `_rowdot_mode`."""
    x = x.float()
    if x.device.type == "cpu":
        if x.shape[0] == 1 and w.shape[0] == 1:
            return torch.linalg.vecdot(x.expand(2, -1), w.expand(2, -1))[:1]
    elif _BATCH_INVARIANT:
        return _rowdot_mode(x, w)
    return torch.linalg.vecdot(x, w)
