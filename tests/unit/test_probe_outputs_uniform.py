"""The frontend's decoding of a fetch's usual case (`probe_results._uniform`: one part a sample, one shared
`wanted`, dense positions of one length) gives the general path's tensors bit for bit, in the same order and
with the same buffer ownership; anything outside that case is left to the general path (None), which
still decodes it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_worker.frontend import probe_results
from vllm_worker.protocol import probe_wire

AGGS = ["mean", "max", "last", "rolling_max:4", "ema:0.9"]


def _part(names: list[str], n: int, n_out: int, g: torch.Generator, block: bool, start: int = 0) -> dict:
    pos = np.arange(start, start + n, dtype=np.int64)
    vals = [(torch.randn(n, n_out, generator=g) * 3).numpy() for _ in names]
    if block:
        got, blk = probe_wire.pack_block(pos.tobytes(), b"".join(v.tobytes() for v in vals), names, n_out)
        return {"probes": got, probe_wire.BLOCK: blk}
    return {"probes": {name: probe_wire.pack_arrays(pos, v) for name, v in zip(names, vals)}}


def _samples(n_req: int, names: list[str], block: bool, seed: int = 0, n: int = 21, n_out: int = 2) -> list:
    g = torch.Generator().manual_seed(seed)
    wanted = {name: {"aggregate": AGGS, "positions": "generated"} for name in names}
    return [([_part(names, n, n_out, g, block)], wanted, 6) for _ in range(n_req)]


def _bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal bits, NaN where the other is NaN (a position no worker scored)."""
    return (
        x.dtype == y.dtype == torch.float32
        and x.shape == y.shape
        and bool(torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(7.5), y.nan_to_num(7.5)))
    )


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (s1, a1), (s2, a2) in zip(a, b):
        assert list(s1) == list(s2) and list(a1) == list(a2)
        for name in s1:
            assert _bits(s1[name], s2[name]) and list(a1[name]) == list(a2[name])
            assert all(_bits(a1[name][k], a2[name][k]) for k in a1[name]), name


@pytest.mark.parametrize("block", [True, False])
@pytest.mark.parametrize("names", [["d"], ["a", "d", "c"]])
def test_the_usual_fetch_decodes_as_the_general_path(block, names):
    samples = _samples(5, names, block)
    got = probe_results._uniform(samples)
    assert got is not None  # (the case it is for)
    _same(got, probe_results._outputs_general(samples))
    _same(probe_results.probe_outputs_many(samples), got)
    # each sample's scores are views of its own buffer: a kept sample pins no other's
    ptrs = [{t.untyped_storage().data_ptr() for t in s.values()} for s, _ in got]
    assert all(len(p) == 1 for p in ptrs) and len(set.union(*ptrs)) == len(samples)
    assert all(t.is_contiguous() for s, _ in got for t in s.values())


def _variants() -> dict:
    """Fetches outside the usual case, each made from the usual one by one change."""
    out = {}
    base = _samples(4, ["a", "d"], True, seed=1)
    s = list(base)
    s[2] = (s[2][0], {**s[2][1]}, s[2][2])  # an equal `wanted`, another object
    out["another wanted object"] = s
    s = list(base)
    s[1] = (s[1][0], s[1][1], 9)
    out["another prompt length"] = s
    s = list(base)
    s[3] = ([_part(["a", "d"], 22, 2, torch.Generator().manual_seed(5), True)], s[3][1], s[3][2])
    out["another length"] = s
    s = list(base)
    s[0] = ([_part(["a", "d"], 21, 2, torch.Generator().manual_seed(5), True, start=2)], s[0][1], s[0][2])
    out["positions not from 0"] = s
    s = list(base)
    s[1] = ([_part(["d", "a"], 21, 2, torch.Generator().manual_seed(5), True)], s[1][1], s[1][2])
    out["another order"] = s
    s = list(base)
    s[2] = ([_part(["a", "d"], 21, 2, torch.Generator().manual_seed(5), False)], s[2][1], s[2][2])
    out["items beside blocks"] = s
    s = list(base)
    s[1] = (s[1][0] * 2, s[1][1], s[1][2])
    out["two parts"] = s
    s = _samples(4, ["a", "d"], False, seed=2)
    wanted = {"a": {"aggregate": AGGS, "positions": [0, 3, 20]}, "d": {"aggregate": AGGS, "positions": [1]}}
    out["chosen positions"] = [(p, wanted, n) for p, _, n in s]
    s = _samples(4, ["a", "d"], False, seed=3)
    wanted = {"a": {"aggregate": ["mean"], "positions": "generated"}, "d": {"aggregate": AGGS, "positions": "all"}}
    out["aggregates per probe"] = [(p, wanted, n) for p, _, n in s]
    return out


@pytest.mark.parametrize("case", list(_variants()))
def test_anything_else_is_left_to_the_general_path(case):
    samples = _variants()[case]
    assert probe_results._uniform(samples) is None
    _same(probe_results.probe_outputs_many(samples), probe_results._outputs_general(samples))


def test_a_malformed_part_is_still_an_error_naming_the_field():
    samples = _samples(3, ["a", "d"], True)
    bad = samples[1][0][0]
    samples[1] = ([{**bad, probe_wire.BLOCK: {**bad[probe_wire.BLOCK], "scores": b"1234"}}], *samples[1][1:])
    assert probe_results._uniform(samples) is None
    with pytest.raises(ValueError, match=r"^probe_scores\.scores"):
        probe_results.probe_outputs_many(samples)


def test_a_part_without_scores_is_still_the_general_paths_error():
    samples = _samples(3, ["a", "d"], True)
    samples[2] = ([{}], *samples[2][1:])
    assert probe_results._uniform(samples) is None
    with pytest.raises(RuntimeError, match="no worker returned the scores of probe 'a'"):
        probe_results.probe_outputs_many(samples)
