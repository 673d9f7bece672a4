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
