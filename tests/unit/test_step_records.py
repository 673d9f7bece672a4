"""`worker/step_records`: a record filled over more steps than one chunk holds (chunks of 1, 2, 4 … 64
steps) gives each span exactly its rows and columns in step order, from host or device-side positions;
`latest` sorts positions and keeps the last run of a position filed twice (a preempted request's
recompute); a fetch's cache reads a record's rows once for every span of them."""

from __future__ import annotations

import numpy as np
import torch

from vllm_worker.worker.step_records import Span, StepRecord, latest, latest_order


def _fill(steps: int, host_pos: bool) -> tuple[StepRecord, torch.Tensor, torch.Tensor]:
    rec = StepRecord(3, {"s": (4, torch.float32)}, torch.device("cpu"))
    vals = torch.randn(steps, 3, 4, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(steps).unsqueeze(1).repeat(1, 3) + torch.tensor([0, 1000, 2000])
    for k in range(steps):
        p = pos[k].numpy() if host_pos else pos[k].clone()
        rec.next(p)["s"].copy_(vals[k])
    return rec, pos, vals


def test_spans_read_their_rows_and_columns_across_chunks():
    for host_pos in (True, False):
        rec, pos, vals = _fill(150, host_pos)  # 1+2+4+8+16+32+64 = 127 steps, then a second 64-step chunk
        assert [c[0].shape[0] for c in rec.chunks] == [1, 2, 4, 8, 16, 32, 64, 64] and rec.steps == 150
        span = Span(rec, 1, 3, "s", slice(1, 3))
        ((p, v),) = span.pieces()
        assert torch.equal(p, pos[:, 1:3].reshape(-1))
        assert torch.equal(v, vals[:, 1:3, 1:3].reshape(-1, 2))
        picked = Span(rec, 0, 1, "s", torch.tensor([3, 0]))
        ((p, v),) = picked.pieces()
        assert torch.equal(p, pos[:, 0]) and torch.equal(v, vals[:, 0][:, [3, 0]])


def test_latest_keeps_the_last_run_and_the_cache_reads_once():
    rec, _, vals = _fill(5, True)
    again = StepRecord(1, {"s": (4, torch.float32)}, torch.device("cpu"))
    redo = torch.full((4,), 7.0)
    again.next(np.array([2]))["s"].copy_(redo.unsqueeze(0))  # position 2 recomputed after a preemption
    first, second = Span(rec, 0, 1, "s", slice(0, 4)), Span(again, 0, 1, "s", slice(0, 4))
    pos, got = latest([*first.pieces(), *second.pieces()])
    assert pos.tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(got[[0, 1, 3, 4]], vals[[0, 1, 3, 4], 0]) and torch.equal(got[2], redo)
    cache: dict = {}
    a, b = Span(rec, 0, 1, "s", slice(0, 1)), Span(rec, 0, 1, "s", slice(1, 4))
    ((pa, va),) = a.pieces(cache=cache)
    ((pb, vb),) = b.pieces(cache=cache)
    assert len(cache) == 1 and pa is pb
    assert torch.equal(torch.cat([va, vb], 1), vals[:, 0])


def test_host_rows_and_latest_order_equal_the_torch_pieces_with_one_host_copy_per_record():
    """The numpy path (fetches and progress RPCs: `probes.payload`) equals `pieces` + `latest` bit for bit —
    columns by slice or index, across chunks, a recomputed position keeping its last row — and copies each
    record to the host once for every span cut from it."""
    for host_pos in (True, False):
        rec, _, _ = _fill(150, host_pos)
        again = StepRecord(3, {"s": (4, torch.float32)}, torch.device("cpu"))
        again.next(np.array([148, 1148, 2148]))["s"].copy_(torch.full((3, 4), 7.0))  # recomputed
        cache: dict = {}
        for r0, r1, cols in ((0, 1, slice(0, 4)), (1, 3, slice(1, 3)), (2, 3, torch.tensor([3, 0]))):
            spans = [Span(rec, r0, r1, "s", cols), Span(again, r0, r1, "s", cols)]
            want_p, want_v = latest([pc for sp in spans for pc in sp.pieces()])
            filed = [sp for sp in spans if sp.host_positions(cache) is not None]
            got_p = np.concatenate([sp.host_positions(cache) for sp in filed])
            got_v = np.concatenate([sp.host_values(cache) for sp in filed])
            order = latest_order(got_p)
            if order is not None:
                got_p, got_v = got_p[order], got_v[order]
            assert np.array_equal(got_p, want_p.numpy()) and got_p.dtype == np.int64
            assert np.array_equal(got_v, want_v.numpy()) and got_v.dtype == np.float32
        assert len(cache) == 2  # one host copy per record, whatever the number of spans
    empty = StepRecord(1, {"s": (4, torch.float32)}, torch.device("cpu"))
    assert Span(empty, 0, 1, "s", slice(0, 4)).host_positions({}) is None
