"""A request's probe scores as the worker sends them (`worker.probes.payload`), against the same scores
worked out from the torch pieces (`Span.pieces` + `step_records.latest`: sorted positions, a recomputed
position keeping its last row, the layers' parts added, bias, sigmoid), bit for bit: a probe over two
sites, probes whose columns move between batch compositions, a preempted request's recompute, a progress
RPC's positions from `start` on, a record with nothing filed; and one shared fetch cache for many requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_worker.protocol import probe_wire
from vllm_worker.worker.probes import DeviceProbe, ProbeScores, payload
from vllm_worker.worker.step_records import Span, StepRecord, latest

COLS = 3  # a record's columns: the probes scored at its site in that composition


def _record(rows: int, positions: list[list[int]], g: torch.Generator) -> StepRecord:
    rec = StepRecord(rows, {"scores": (COLS, torch.float32)}, torch.device("cpu"))
    for step in positions:
        rec.next(np.array(step, dtype=np.int64))["scores"].copy_(torch.randn(rows, COLS, generator=g))
    return rec


def _probe(name: str, sites: list[int], sigmoid: bool, g: torch.Generator) -> DeviceProbe:
    return DeviceProbe(name, name, {s: torch.zeros(1, 4) for s in sites}, torch.randn(1, generator=g), sigmoid, sites)


def _requests(g: torch.Generator) -> list[dict[str, ProbeScores]]:
    """Three requests in two compositions at sites 4 and 6 (a prefill record of 3 rows each, then decode
    records of a row each); request 1 is preempted and recomputes positions 3..4 in a third composition."""
    prefill = {s: _record(9, [[0, 1, 2] * 3], g) for s in (4, 6)}
    decode = {s: _record(3, [[3, 3, 3], [4, 4, 4], [5, 5, 5], [6, 6, 6]], g) for s in (4, 6)}
    redo = {s: _record(1, [[3], [4]], g) for s in (4, 6)}
    empty = StepRecord(1, {"scores": (COLS, torch.float32)}, torch.device("cpu"))
    probes = {
        "one": _probe("one", [4], False, g),
        "two": _probe("two", [4, 6], True, g),  # two layers: the sites' parts added
        "sig": _probe("sig", [6], True, g),
    }
    out = []
    for i in range(3):
        got = {}
        for name, p in probes.items():
            c = {"one": 0, "two": 1, "sig": 2}[name]
            spans: dict[int, list[Span]] = {}
            for s in p.sites:
                spans[s] = [
                    Span(prefill[s], 3 * i, 3 * i + 3, "scores", slice(c, c + 1)),
                    # a later composition holds the probes in another column order
                    Span(decode[s], i, i + 1, "scores", torch.tensor([2 - c])),
                ]
                if i == 1:
                    spans[s] += [
                        Span(empty, 0, 1, "scores", slice(0, 1)),
                        Span(redo[s], 0, 1, "scores", slice(c, c + 1)),
                    ]
            got[name] = ProbeScores(p, spans)
        out.append(got)
    return out


def _want(got: dict[str, ProbeScores], start: int, running: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    want = {}
    for name, slot in got.items():
        total, pos = None, None
        for s in slot.probe.sites:
            pieces = [pc for sp in slot.spans[s] for pc in sp.pieces()]
            if start > 0:  # the pieces back to the first reaching below `start`
                i = max(k for k, (p, _) in enumerate(pieces) if len(p) and int(p.min()) < start)
                pieces = pieces[i:]
            p, v = latest(pieces)
            if running:
                p, v = p[p >= start], v[p >= start]
            pos, total = p, (v.clone() if total is None else total + v)
        assert pos is not None and total is not None
        total = total + slot.probe.bias
        want[name] = (pos, torch.sigmoid(total) if slot.probe.sigmoid else total)
    return want


def _check(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, (pos, scores) in want.items():
        p, s = (torch.from_numpy(a.copy()) for a in probe_wire.arrays(got[name], name))
        assert p.dtype == torch.int64 and s.dtype == torch.float32
        assert torch.equal(p, pos) and torch.equal(s, scores), name


@pytest.mark.parametrize("shared", [False, True])
def test_payload_equals_the_torch_pieces_bit_for_bit(shared):
    reqs = _requests(torch.Generator().manual_seed(2))
    cache: dict = {}
    for got in reqs:
        _check(payload(got, cache=cache if shared else None), _want(got, 0, False))
    assert probe_wire.arrays(payload(reqs[1])["one"], "one")[0].tolist() == list(range(7))


def test_progress_payload_from_start_equals_the_torch_pieces():
    reqs = _requests(torch.Generator().manual_seed(4))
    for start in (1, 3, 4, 6):
        for got in reqs:
            _check(payload(got, start, running=True, cache={}), _want(got, start, True))
    assert payload(reqs[0], 7, running=True) == {  # nothing new: every probe, no rows
        name: {"positions": b"", "scores": b"", "n_out": 1} for name in ("one", "two", "sig")
    }


def test_nothing_scored_is_an_error_when_finished_and_left_out_while_running():
    g = torch.Generator().manual_seed(5)
    empty = StepRecord(1, {"scores": (COLS, torch.float32)}, torch.device("cpu"))
    got = {"one": ProbeScores(_probe("one", [4], False, g), {4: [Span(empty, 0, 1, "scores", slice(0, 1))]})}
    assert payload(got, 0, running=True) == {}
    with pytest.raises(RuntimeError, match="no rows were scored"):
        payload(got)


def test_a_two_site_probe_with_one_site_unscored_is_left_out_while_running():
    """Never a partial sum: a progress RPC leaves out a probe until every one of its sites has rows."""
    g = torch.Generator().manual_seed(6)
    rec = _record(1, [[0], [1]], g)
    empty = StepRecord(1, {"scores": (COLS, torch.float32)}, torch.device("cpu"))
    spans = {4: [Span(rec, 0, 1, "scores", slice(0, 1))], 6: [Span(empty, 0, 1, "scores", slice(0, 1))]}
    got = {"two": ProbeScores(_probe("two", [4, 6], False, g), spans)}
    assert payload(got, 0, running=True) == {}
    with pytest.raises(RuntimeError, match="no rows were scored at 6"):
        payload(got)
