"""`admission.ToDevice`: a failed move keeps its queue (the caller fails the requests it belonged to),
a good one empties it."""

from __future__ import annotations

import pytest
import torch

from vllm_worker.worker.admission import ToDevice


def test_a_failed_flush_keeps_the_queue_and_a_good_one_empties_it():
    moves = ToDevice(torch.device("cpu"))
    got: dict[str, torch.Tensor] = {}

    def bad(_: torch.Tensor) -> None:
        raise RuntimeError("device lost")

    moves.add(torch.ones(3), lambda t: got.__setitem__("a", t))
    moves.add(torch.zeros(2), bad)
    with pytest.raises(RuntimeError, match="device lost"):
        moves.flush()
    assert len(moves._items) == 2  # nothing dropped without a word
    moves.clear()
    moves.add(torch.ones(3), lambda t: got.__setitem__("b", t))
    moves.add(torch.arange(4), lambda t: got.__setitem__("c", t))
    moves.flush()
    assert not moves._items
    assert torch.equal(got["b"], torch.ones(3)) and torch.equal(got["c"], torch.arange(4))


def test_the_steering_entry_queue_leaves_only_once_copied(monkeypatch):
    """`graph_entries.SteeringEntries.flush`: the same rule for the graph path's steering entries."""
    from vllm_worker.worker import graph_entries

    table = graph_entries.SteeringEntries(4, 8, torch.float32, torch.device("cpu"))
    (i,) = table.add(torch.ones(1, 8), torch.ones(1, 8))  # (an entry of the public kind: B != 0, flagged)
    real = graph_entries.to_device
    monkeypatch.setattr(graph_entries, "to_device", lambda *a: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        table.flush()
    assert list(table._new) == [i]  # still queued: the caller fails its requests, then clears
    monkeypatch.setattr(graph_entries, "to_device", real)
    table.flush()
    assert not table._new and torch.equal(table.A[i], torch.ones(8)) and bool(table.bflag[i]) and table.gate[i] == 1
    table.add(torch.ones(1, 8), torch.zeros(1, 8), gated=True)  # gated: its gate starts at 0
    table.clear()
    assert not table._new
