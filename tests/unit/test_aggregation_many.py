"""The fetch-wide probe outputs against their per-series definitions, bit for bit (no engine): the stacked
aggregates (`aggregation.aggregates_many`), one fetch's samples decoded together
(`probe_results.probe_outputs_many`) and the frontend's `_apply` over real vLLM outputs — samples of different
lengths, a failed one among them, chosen positions, a rolling window longer than the series, a position no
worker scored (NaN)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from vllm.outputs import CompletionOutput, RequestOutput

from vllm_worker.frontend import fetch, probe_results
from vllm_worker.frontend.probe_results import chosen, probe_outputs, probe_outputs_many
from vllm_worker.frontend.state import Pending
from vllm_worker.probes import aggregation
from vllm_worker.protocol import probe_wire

NAMES = ["mean", "max", "last", "rolling_max:3", "rolling_max:50", "ema:0.9", "ema:0", "ema:0.37"]


def _old_ema(x: torch.Tensor, a: float) -> torch.Tensor:
    """`series(x, "ema:A")` as it was written before the stacked form: one position at a time."""
    out = torch.empty_like(x)
    e = x[0] if x.shape[0] else x.new_zeros(x.shape[1:])
    for t in range(x.shape[0]):
        e = a * e + (1.0 - a) * x[t] if t else x[0]
        out[t] = e
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits (NaN where the other is NaN), shape and dtype."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.nan_to_num(7.5), b.nan_to_num(7.5)))


@pytest.mark.parametrize("a", [0.0, 0.37, 0.9, 0.999])
def test_ema_series_is_the_recurrence_bit_for_bit(a):
    g = torch.Generator().manual_seed(3)
    for shape in [(0,), (1,), (7,), (200,), (0, 2), (5, 3), (129, 1)]:
        x = torch.randn(*shape, generator=g) * 4
        assert _same(aggregation.series(x, f"ema:{a}"), _old_ema(x, a)), shape


def test_stacked_aggregates_equal_each_series_alone():
    g = torch.Generator().manual_seed(5)
    items = []
    for n, n_out in [(0, 1), (1, 1), (2, 1), (3, 1), (49, 1), (50, 1), (129, 1), (129, 1), (129, 2), (7, 3)]:
        for _ in range(3):
            x = torch.randn(n, n_out, generator=g) * 3
            items.append((x, NAMES[: 3 + (n % 6)]))
    items.append((torch.tensor([[1.0], [math.nan], [2.0]]), NAMES))
    got = aggregation.aggregates_many(items)
    assert len(got) == len(items)
    for (x, wanted), res in zip(items, got):
        assert list(res) == wanted
        for name in wanted:
            assert _same(res[name], aggregation.aggregate(x, name)), (tuple(x.shape), name)
            if name.startswith("ema:") and x.shape[0]:
                assert _same(res[name], _old_ema(x, float(name[4:])).max(0).values)


def test_stacked_aggregates_refuse_a_series_name():
    with pytest.raises(ValueError, match="token"):
        aggregation.aggregates_many([(torch.zeros(3, 1), ["token"])])


def _part(pos: list[int], scores: torch.Tensor, name: str) -> dict:
    """One worker's part as `worker.probes.payload` writes it."""
    return {"probes": {name: probe_wire.pack_arrays(np.array(pos, dtype=np.int64), scores.numpy())}}


def _samples() -> list[tuple[list[dict], dict, int]]:
    """Samples of different lengths and probes: a gap (NaN), chosen positions, windows longer than the series."""
    g = torch.Generator().manual_seed(11)
    out = []
    for i, (n, prompt) in enumerate([(40, 30), (12, 5), (40, 30), (3, 2), (31, 30), (60, 10)]):
        pos = [p for p in range(n) if not (i == 5 and p == 20)]  # sample 5: position 20 was not scored
        wanted = {
            "a": {"aggregate": ["mean", "max", "last"], "positions": "generated"},
            "b": {"aggregate": ["rolling_max:16", "ema:0.9", "mean"], "positions": "all" if i % 2 else "prompt"},
            "c": {"aggregate": ["max", "ema:0.5"], "positions": [0, 2, 3, 100]},
        }
        parts = [_part(pos, torch.randn(len(pos), 1, generator=g), k) for k in ("a", "b")]
        parts.append(_part(pos, torch.randn(len(pos), 2, generator=g), "c"))
        out.append((parts, wanted, prompt))
    return out


def _reference(parts: list[dict], wanted: dict, prompt_len: int) -> tuple[dict, dict]:
    """The per-sample definition: dense scores by position, then `aggregation.aggregate` of each name."""
    scores = {}
    for part in parts:
        for name, got in part["probes"].items():
            pos, raw = probe_wire.arrays(got, name)
            s = torch.from_numpy(raw.copy())
            dense = torch.full((int(pos.max()) + 1, s.shape[1]), math.nan)
            dense[torch.from_numpy(pos.copy())] = s
            scores[name] = dense
    aggs = {
        name: {
            a: aggregation.aggregate(scores[name][chosen(scores[name].shape[0], prompt_len, o["positions"])], a)
            for a in o["aggregate"]
        }
        for name, o in wanted.items()
    }
    return scores, aggs


def _check(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    assert list(got[0]) == list(want[0]) and list(got[1]) == list(want[1])
    for name in want[0]:
        assert _same(got[0][name], want[0][name]), name
    for name, aggs in want[1].items():
        assert list(got[1][name]) == list(aggs)
        for a, v in aggs.items():
            assert _same(got[1][name][a], v), (name, a)


def test_one_fetch_of_many_samples_equals_each_sample_alone():
    samples = _samples()
    many = probe_outputs_many(samples)
    for sample, got in zip(samples, many):
        want = _reference(*sample)
        _check(got, want)
        _check(probe_outputs(*sample), want)
    assert bool(many[5][0]["a"][20].isnan().all())  # the gap: NaN, never a shift
    assert many[1][1]["b"]["rolling_max:16"].item() == pytest.approx(many[1][0]["b"].mean().item(), abs=1e-6)


def test_apply_decodes_every_sample_and_keeps_a_failure_apart():
    """`_apply` (as `LLM.generate` does) over real vLLM outputs: a request whose worker failed gets its
    failure; every other one gets the per-sample definition's scores and aggregates."""
    samples = _samples()
    err = {"kind": "hook", "message": "boom", "stage": "hook output"}
    todo, fetched = [], {}
    for i, (parts, wanted, prompt) in enumerate(samples):
        n_pos = max(int(np.frombuffer(p["probes"][k]["positions"], np.int64).max()) for p in parts for k in p["probes"])
        c = CompletionOutput(0, "", list(range(n_pos + 1 - prompt)), None, None)
        out = RequestOutput(f"r{i}", None, list(range(prompt)), None, [c], True)
        todo.append((out, Pending(f"k{i}", 1, [], 8, probes=wanted, prompt_len=prompt), {0: c}, {0: n_pos}))
        fetched[f"k{i}"] = {0: parts} if i != 2 else {0: [{"error": err}]}
    failures = fetch._apply(todo, fetched)
    assert list(failures) == ["r2"] and failures["r2"]["kind"] == "hook"
    for i, (out, _, _, _) in enumerate(todo):
        if i == 2:
            assert out.activations is None and out.hook_error == "boom"
            continue
        acts = out.outputs[0].activations
        _check((acts["probe_scores"], acts["probe_aggregates"]), _reference(*samples[i]))
        assert out.activations is acts


def test_parts_with_memoryviews_decode_and_a_bad_item_names_its_field():
    """A part whose bytes arrive as memoryviews decodes as bytes do; a bad item (scores not n x n_out float32,
    positions not int64, n_out not an int) is a ValueError naming its field."""
    a = torch.randn(3, 1)
    plain = probe_wire.pack_arrays(np.arange(3), a.numpy())
    twice = probe_wire.pack_arrays(np.arange(3), (a * 2).numpy())
    view = {**twice, "positions": memoryview(twice["positions"]), "scores": memoryview(twice["scores"])}
    wanted = {"p": {"aggregate": ["max"], "positions": "all"}, "q": {"aggregate": ["max"], "positions": "all"}}
    scores, aggs = probe_outputs([{"probes": {"p": plain, "q": view}}], wanted, 1)
    assert torch.equal(scores["p"], a) and torch.equal(scores["q"], a * 2)
    assert torch.equal(aggs["q"]["max"], (a * 2).max(0).values)
    for bad, field in (
        ({**plain, "scores": b"\0" * 8}, "scores"),
        ({**plain, "positions": b"\0" * 7}, "positions"),
        ({**plain, "n_out": 1.0}, "n_out"),
        ([plain], ""),
    ):
        with pytest.raises(ValueError, match=rf"probe_scores\.q\b\.?{field}"):
            probe_outputs([{"probes": {"p": plain, "q": bad}}], wanted, 1)


def test_one_part_with_many_probes_reads_shared_positions_once_and_others_apart():
    """A worker's part holds all its probes: equal positions are read once, other ones (a gap, fewer) and
    another width still give each probe its own scores by position."""
    g = torch.Generator().manual_seed(13)
    spec = {"x": ([0, 1, 2, 3, 4], 1), "y": ([0, 1, 2, 3, 4], 1), "z": ([0, 2, 3], 1), "w": ([0, 1, 2, 3, 4], 2)}
    probes = {}
    for name, (pos, width) in spec.items():
        probes[name] = _part(pos, torch.randn(len(pos), width, generator=g), name)["probes"][name]
    wanted = {name: {"aggregate": ["mean", "ema:0.5"], "positions": "all"} for name in spec}
    for names in (["x", "y", "z"], ["x", "y", "w", "z"]):
        parts = [{"probes": {n: probes[n] for n in names}}]
        got = probe_outputs(parts, {n: wanted[n] for n in names}, 2)
        _check(got, _reference(parts, {n: wanted[n] for n in names}, 2))
        assert bool(got[0]["z"][1].isnan().all()) and got[0]["z"].shape == (4, 1)
        got[0]["x"][0, 0] = 99.0  # each probe's scores are its own rows of the part's buffer
        assert got[0]["y"][0, 0].item() != 99.0


@pytest.mark.parametrize("form", ["uniform", "reordered", "mixed_lists"])
def test_one_shaped_fetch_read_in_place_equals_each_sample_alone(form, monkeypatch):
    """W10's form (every sample's probes one shape, the same positions chosen): aggregates read from the one
    decoded buffer, in the parts' order or not, with one list of names or several, against the definition."""
    g = torch.Generator().manual_seed(13)
    pos = list(range(37))
    samples = []
    for i in range(9):
        names = ["p0", "p1", "p2"] if form != "reordered" or i % 2 else ["p2", "p0", "p1"]
        aggs = NAMES if form != "mixed_lists" else NAMES[: 2 + i % 5]
        wanted = {k: {"aggregate": aggs, "positions": "generated"} for k in names}
        probes = {
            k: probe_wire.pack_arrays(np.array(pos), torch.randn(37, 2, generator=g).numpy())
            for k in ("p0", "p1", "p2")
        }
        samples.append(([{"probes": probes}], wanted, 30))
    monkeypatch.setattr(probe_results, "aggregates_many", None)  # (read in place: never stacked per entry)
    for sample, got in zip(samples, probe_outputs_many(samples)):
        _check(got, _reference(*sample))


def test_a_sample_keeps_only_its_own_scores_buffer():
    """Aggregates are read from one fetch-wide array, but each sample's scores are views of its own part's
    buffer: a caller keeping one request's outputs keeps no other request's scores alive."""
    g = torch.Generator().manual_seed(17)
    samples = []
    for _ in range(3):
        probes = {k: probe_wire.pack_arrays(np.arange(9), torch.randn(9, 1, generator=g).numpy()) for k in ("a", "b")}
        samples.append(([{"probes": probes}], {k: {"aggregate": ["mean"], "positions": "all"} for k in "ab"}, 4))
    got = probe_outputs_many(samples)
    buffers = [{s.untyped_storage().data_ptr() for s in scores.values()} for scores, _ in got]
    assert all(len(b) == 1 for b in buffers)  # a sample's probes: one buffer
    assert len(set.union(*buffers)) == 3  # each sample its own
    for scores, _ in got:
        assert scores["a"].untyped_storage().nbytes() == 2 * 9 * 4
