"""The frontend decodes probe scores in one torch thread (`probe_results.probe_outputs_many` under
`host_threads.one_thread`: waking torch's pool cost more than the small copies and reductions), with the
same bits as in torch's pool (a reduction computes each output in one thread either way), and gives the
caller's thread count back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_worker.frontend import probe_results
from vllm_worker.probes import aggregation
from vllm_worker.protocol import host_threads, probe_wire

NAMES = ["mean", "max", "last", "rolling_max:16", "ema:0.9"]
pool = pytest.mark.skipif(not host_threads._OPENMP, reason="torch's pool is resized only with OpenMP")
# torch.set_num_threads as a GPU server's frontend has it, also after an in-process CPU engine replaced it
# (tests/core/test_compiled.py's runs first in CI's unit + core + engine process)
resizable = pytest.mark.usefixtures("resizable_pool")


def _samples(n_req: int, n_probes: int, n: int, n_out: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    pos = np.arange(n, dtype=np.int64)
    wanted = {f"p{j}": {"aggregate": NAMES, "positions": "generated"} for j in range(n_probes)}
    out = []
    for _ in range(n_req):
        items = {k: probe_wire.pack_arrays(pos, (torch.randn(n, n_out, generator=g) * 3).numpy()) for k in wanted}
        out.append(([{"probes": items}], wanted, 30))
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaN where the other is NaN (a series shorter than its prompt has no generated position)."""
    return a.shape == b.shape and bool(
        torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(7.5), b.nan_to_num(7.5))
    )


def _flat(outs: list) -> list[torch.Tensor]:
    return [t for scores, aggs in outs for t in [*scores.values(), *(x for a in aggs.values() for x in a.values())]]


@pool
@resizable
def test_decoding_in_one_thread_restores_the_callers_pool(monkeypatch):
    seen = []
    real = aggregation.aggregates_stacked

    def spy(x, wanted):  # our own function, wrapped to read the thread count it runs with
        seen.append(torch.get_num_threads())
        return real(x, wanted)

    monkeypatch.setattr(probe_results, "aggregates_stacked", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outs = probe_results.probe_outputs_many(_samples(4, 2, 40, 1, 0))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen == [1] and len(outs) == 4 and outs[0][1]["p0"]["mean"].shape == (1,)


@pool
@resizable
@pytest.mark.parametrize("shape", [(256, 8, 158, 1), (64, 1, 158, 1), (3, 2, 1000, 3), (1, 1, 5000, 1), (2, 3, 7, 2)])
def test_aggregates_are_the_same_bits_in_one_thread_and_in_the_pool(shape):
    n_req, n_probes, n, n_out = shape
    samples = _samples(n_req, n_probes, n, n_out, 1)
    before = torch.get_num_threads()
    x = torch.randn(n_req * n_probes, n, n_out, generator=torch.Generator().manual_seed(2))
    try:
        got = {}
        for threads in (1, 4):
            torch.set_num_threads(threads)
            # the stacked aggregates as computed in torch's pool of `threads`, and the whole decoding
            stacked = aggregation.aggregates_stacked(x[:, 29:].contiguous(), [NAMES] * len(x))
            got[threads] = [t for d in stacked for t in d.values()] + _flat(probe_results._outputs_many(samples))
    finally:
        torch.set_num_threads(before)
    assert len(got[1]) == len(got[4])
    assert all(_same(a, b) for a, b in zip(got[1], got[4]))


@pool
@resizable
def test_a_lone_long_series_aggregates_as_it_does_batched():
    """One output summed over 32768+ positions is split across torch's pool (other bits than one thread,
    and than the same series among others, each output of which one thread sums): decoded in one thread, a
    lone request's aggregates are the bits it gets in a batch."""
    many = _samples(3, 1, 40000, 1, 4)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        alone = probe_results.probe_outputs_many(many[:1])[0][1]["p0"]
        batched = probe_results.probe_outputs_many(many)[0][1]["p0"]
    finally:
        torch.set_num_threads(before)
    assert list(alone) == NAMES and all(_same(alone[k], batched[k]) for k in NAMES)
