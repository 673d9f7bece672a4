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


def _block() -> tuple[dict, dict, dict]:
    """A part's probes as one block and as items: a (2 outputs) and b (1), over the same 5 positions."""
    g = np.random.default_rng(2)
    pos = np.arange(5, dtype=np.int64)
    a, b = g.standard_normal((5, 2), dtype=np.float32), g.standard_normal((5, 1), dtype=np.float32)
    items = {"a": probe_wire.pack_arrays(pos, a), "b": probe_wire.pack_arrays(pos, b)}
    names = {"a": 2, "b": 1}
    return names, {"positions": pos.tobytes(), "scores": a.tobytes() + b.tobytes()}, items


def test_a_block_reads_as_its_items():
    names, block, items = _block()
    part = {"probes": names, probe_wire.BLOCK: block}
    assert probe_wire.items_of(part) == items and list(probe_wire.items_of(part)) == ["a", "b"]
    assert probe_wire.items_of({"probes": items}) == items  # (items: as they are)
    pos, vals, n, ks = probe_wire.unpack_block(names, {k: memoryview(v) for k, v in block.items()}, "probe_scores")
    assert (pos, vals, n, ks) == (block["positions"], block["scores"], 5, [2, 1])
    assert type(pos) is bytes and type(vals) is bytes
    names1, block1 = probe_wire.pack_block(block["positions"], items["a"]["scores"] * 2, ["x", "y"], 2)
    assert names1 == {"x": 2, "y": 2} and probe_wire.items_of({"probes": names1, probe_wire.BLOCK: block1}) == {
        "x": items["a"],
        "y": items["a"],
    }


@pytest.mark.parametrize(
    "names, block, field",
    [
        ([2, 1], None, "probe_scores"),
        ({"a": 2, "b": 1.0}, None, "probe_scores.b.n_out"),
        ({"a": -1, "b": 1}, None, "probe_scores.a.n_out"),
        (None, {"positions": b"1234567"}, "probe_scores.positions"),
        (None, {"positions": "x"}, "probe_scores.positions"),
        (None, {"scores": b"1234"}, "probe_scores.scores"),
        (None, {"scores": None}, "probe_scores.scores"),
        (None, [1], "probe_scores"),
    ],
)
def test_a_malformed_block_is_a_value_error_naming_the_field(names, block, field):
    good_names, good_block, _ = _block()
    names = good_names if names is None else names
    block = {**good_block, **block} if isinstance(block, dict) else good_block if block is None else block
    with pytest.raises(ValueError) as got:
        probe_wire.unpack_block(names, block, "probe_scores")
    assert str(got.value).startswith(field)
