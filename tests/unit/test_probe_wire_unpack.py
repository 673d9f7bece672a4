"""`probe_wire.unpack_into` (a part's items without a call each) gives what `unpack` gives item by item —
bytes, memoryview and bytearray forms, zero outputs, no positions — and the same ValueError, naming the same
field, for every malformed item."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_worker.protocol import probe_wire


def _items() -> dict:
    g = np.random.default_rng(1)
    pos = np.arange(5, dtype=np.int64)
    a = probe_wire.pack_arrays(pos, g.standard_normal((5, 2), dtype=np.float32))
    return {
        "a": a,
        "view": {**a, "scores": memoryview(a["scores"])},
        "ba": {**a, "positions": bytearray(a["positions"])},
        "zero": probe_wire.pack_arrays(pos, np.zeros((5, 0), dtype=np.float32)),
        "empty": probe_wire.pack_arrays(pos[:0], np.zeros((0, 1), dtype=np.float32)),
    }


def test_the_same_as_unpack_item_by_item():
    items = _items()
    got: tuple[list, list, list, list] = ([], [], [], [])
    probe_wire.unpack_into(items, "probe_scores", *got)
    want = [probe_wire.unpack(v, f"probe_scores.{k}") for k, v in items.items()]
    assert list(zip(*got)) == want
    assert all(type(p) is bytes and type(v) is bytes for p, v, _, _ in want)


@pytest.mark.parametrize(
    "bad",
    [
        [1, 2],
        {"positions": b"1234567", "scores": b"", "n_out": 1},
        {"positions": b"", "scores": b"", "n_out": -1},
        {"positions": b"", "scores": b"", "n_out": 1.0},
        {"positions": bytes(8), "scores": bytes(4), "n_out": 2},
        {"positions": "x", "scores": b"", "n_out": 0},
        {"positions": bytes(8), "scores": None, "n_out": 1},
    ],
)
def test_a_malformed_item_raises_as_unpack_does(bad):
    items = {"a": _items()["a"], "bad": bad}
    with pytest.raises(ValueError) as want:
        probe_wire.unpack(bad, "probe_scores.bad")
    with pytest.raises(ValueError) as got:
        probe_wire.unpack_into(items, "probe_scores", [], [], [], [])
    assert str(got.value) == str(want.value) and "probe_scores.bad" in str(got.value)
