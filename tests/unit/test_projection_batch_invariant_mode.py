"""Probe projections under vLLM's batch-invariant mode (`worker/projection`, the worker's one read of
`compat.batch_invariant_mode()` forced on here): the CPU path is unchanged, bit for bit; the path a GPU then
takes (`_project_mode` / `_rowdot_mode`, device-agnostic, run on CPU tensors here) computes the same formula
within float32 rounding, gives a row the same bits alone and among others, and dispatches no aten op but
elementwise ones, copies and the ones the mode replaces (`compat.batch_invariance.USED_OPS`) — never a
matmul or a plain sum, which the mode leaves to cuBLAS / torch."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_worker.compat.batch_invariance import USED_OPS
from vllm_worker.worker import projection
from vllm_worker.worker.projection import project, rowdot

# aten ops that neither reduce nor multiply matrices: elementwise, copies, views, allocation
ELEMENTWISE = {"aten::mul.Tensor", "aten::mul_.Tensor", "aten::mul_.Scalar", "aten::copy_", "aten::empty.memory_format"}
VIEWS = {"aten::unsqueeze", "aten::narrow", "aten::slice.Tensor", "aten::view", "aten::expand", "aten::t"}


class _Ops(TorchDispatchMode):
    """The aten ops a block of code dispatches, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.add(func.name())
        return func(*args, **(kwargs or {}))


def _data(d: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, d, generator=g).bfloat16().float()  # rows as a bf16 model stages them
    return x, torch.randn(n, d, generator=g) / d**0.5, torch.randn(300, d, generator=g)


@pytest.mark.parametrize("d, n", [(64, 1), (576, 3), (4096, 16)])
def test_the_cpu_path_is_unchanged_with_the_mode_on(monkeypatch, d, n):
    x, w, pw = _data(d, n, d + n)
    before = torch.empty(300, n)
    project(x, w, before)
    rows_before = rowdot(x, pw)
    monkeypatch.setattr(projection, "_BATCH_INVARIANT", True)
    after = torch.empty(300, n)
    project(x, w, after)
    assert torch.equal(after, before)
    assert torch.equal(rowdot(x, pw), rows_before)
    assert torch.equal(rowdot(x[7:8], pw[7:8]), rows_before[7:8])


@pytest.mark.parametrize("d, n", [(64, 1), (576, 3), (1000, 2), (4096, 16)])
def test_the_modes_path_is_the_formula_and_a_rows_result_does_not_depend_on_the_others(monkeypatch, d, n):
    monkeypatch.setattr(projection, "_BATCH_INVARIANT", True)
    monkeypatch.setattr(projection, "_MODE_CHUNK", 1 << 16)  # several chunks of rows, as a long prefill has
    x, w, pw = _data(d, n, d * n)
    full = torch.empty(300, n)
    project(x, w, full, rowwise=False)  # the GPU branch, on CPU tensors
    ref = x.double() @ w.double().T
    assert (full.double() - ref).abs().max() <= 2e-6 * max(1.0, float(ref.abs().max()))
    for j, m in ((0, 1), (0, 7), (5, 255), (299, 1)):
        out = torch.empty(m, n)
        project(x[j : j + m], w, out, rowwise=False)
        assert torch.equal(out, full[j : j + m]), (j, m)
    # several sites at once, into a view of a wider record (as `StagedProbes` projects)
    rec = torch.zeros(2, 40, n + 1)
    project(torch.stack([x[:40], x[100:140]]), torch.stack([w, w.flip(0)]), rec[..., :n], rowwise=False)
    assert torch.equal(rec[0, :, :n], full[:40]) and not rec[..., n].any()
    alone = torch.empty(1, n)
    project(x[100:101], w.flip(0), alone, rowwise=False)
    assert torch.equal(rec[1, :1, :n], alone)
    # probe actions: one (row, weight) pair a score
    pairs = projection._rowdot_mode(x, pw)
    exact = (x.double() * pw.double()).sum(-1)
    assert (pairs.double() - exact).abs().max() <= 2e-6 * d**0.5 * float(exact.abs().max())
    for j, m in ((0, 1), (3, 7), (40, 255)):
        assert torch.equal(projection._rowdot_mode(x[j : j + m], pw[j : j + m]), pairs[j : j + m])
    if d & (d - 1) == 0:  # d a power of two: mean times d is exactly the float32 sum the kernel made
        assert torch.equal(pairs, (x * pw).sum(-1))


def test_the_modes_path_runs_only_ops_the_mode_replaces(monkeypatch):
    monkeypatch.setattr(projection, "_BATCH_INVARIANT", True)
    x, w, pw = _data(576, 3, 1)
    with _Ops() as one:
        project(x, w, torch.empty(300, 3), rowwise=False)
    xs, ws, out = torch.stack([x, x]), torch.stack([w, w]), torch.empty(2, 300, 3)
    with _Ops() as sites:
        project(xs, ws, out, rowwise=False)
    with _Ops() as pairs:
        projection._rowdot_mode(x, pw)
    for ops in (one.names, sites.names, pairs.names):
        computing = ops - ELEMENTWISE - VIEWS
        assert computing == set(USED_OPS), ops
    # without the mode the same call is one matmul (what cuBLAS runs on a GPU)
    monkeypatch.setattr(projection, "_BATCH_INVARIANT", False)
    with _Ops() as plain:
        project(x, w, torch.empty(300, 3), rowwise=False)
    assert "aten::mm.out" in plain.names and "aten::mean.dim" not in plain.names


def test_a_worker_reads_the_mode_once_and_only_for_a_gpu(monkeypatch):
    from vllm_worker import compat
    from vllm_worker.worker import probes

    reads = []
    monkeypatch.setattr(compat, "batch_invariant_mode", lambda: reads.append(1) or True)
    monkeypatch.setattr(projection, "_BATCH_INVARIANT", False)  # restored after the test
    probes.WorkerProbes(torch.device("cpu"), frozenset())
    assert projection._BATCH_INVARIANT is False and not reads  # a CPU worker never asks vLLM
    probes.WorkerProbes(torch.device("cuda"), frozenset())  # (no CUDA needed: nothing is allocated)
    assert projection._BATCH_INVARIANT is True and len(reads) == 1
