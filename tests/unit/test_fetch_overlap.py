"""An overlapped fetch (`frontend.fetch._overlapped`) decodes its round trips one at a time: the outputs it
gives equal one decoding of the whole fetch bit for bit — scores, aggregates, dtypes, shapes, names in order,
per-request failures — for probes of one and two outputs, requests of different lengths (more than one
aggregate path), one with named positions and one whose workers failed. And which fetches are split at all
(`_overlap_chunks`): never captures, never below the setting or the minimum items a round trip.
(The worker side: a request's payload does not depend on the others fetched with it,
tests/unit/test_probe_payloads.py; the round trips through a real engine core: tests/engine/test_multiprocess.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_worker.frontend import fetch as frontend_fetch
from vllm_worker.frontend.state import Pending
from vllm_worker.protocol import probe_wire

AGGS = ["mean", "max", "last", "rolling_max:4", "ema:0.9"]


def _fetch(n_req: int) -> tuple[list, dict]:
    """(todo, fetched) as `attach_outputs` has them: n_req finished outputs with their pending entries and
    their workers' parts (probes "a" (1 output), "b" (2 outputs); every third request longer)."""
    g = np.random.default_rng(7)
    todo, fetched = [], {}
    for i in range(n_req):
        prompt, new = 5, 9 + 4 * (i % 3 == 0)
        n = prompt + new - 1
        wanted = {"a": {"aggregate": AGGS, "positions": "generated"}, "b": {"aggregate": ["mean", "max"]}}
        if i == 4:  # named positions: the per-series path
            wanted["a"] = {"aggregate": ["mean", "last"], "positions": [1, 3, 6]}
        c = SimpleNamespace(index=0, token_ids=[0] * new)
        out = SimpleNamespace(request_id=f"r{i}", outputs=[c], prompt_token_ids=[0] * prompt)
        p = Pending(key=f"k{i}", n=1, layers=[], d_model=8, probes=wanted, prompt_len=prompt)
        todo.append((out, p, {0: c}, {0: n}))
        if i == 7:  # this request's workers failed: its own hook error, nobody else's
            fetched[p.key] = {"error": {"kind": "hook", "message": "boom", "where": "fetch"}}
            continue
        pos = np.arange(n, dtype=np.int64)
        items = {k: probe_wire.pack_arrays(pos, g.standard_normal((n, w), dtype=np.float32)) for k, w in (("a", 1), ("b", 2))}  # fmt: skip
        fetched[p.key] = {0: [{"probes": items}]}
    return todo, fetched


def _results(todo: list) -> list:
    return [(o.activations, o.hook_error) for o, _, _, _ in todo]


def _same(x: object, y: object) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and x.equal(y)
    if isinstance(x, dict):
        return isinstance(y, dict) and list(x) == list(y) and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))  # type: ignore[arg-type]
    return x == y


@pytest.mark.parametrize("size", [1, 3, 8])
def test_decoding_round_trip_by_round_trip_equals_one_decoding(size):
    todo, fetched = _fetch(20)
    want = frontend_fetch._apply(todo, fetched)
    whole = _results(todo)
    todo2, fetched2 = _fetch(20)
    got: dict = {}
    for k in range(0, len(todo2), size):
        chunk = todo2[k : k + size]
        got.update(frontend_fetch._apply(chunk, {p.key: fetched2[p.key] for _, p, _, _ in chunk}))
    assert _same(whole, _results(todo2))
    assert got == want and list(want) == ["r7"]  # the failed request's error, once, named
    scores = todo2[0][0].activations["probe_scores"]
    assert scores["b"].shape == (17, 2) and list(todo2[0][0].activations["probe_aggregates"]["a"]) == AGGS


def test_which_fetches_are_split(monkeypatch):
    todo, _ = _fetch(40)  # 40 requests x 2 probes: 80 items
    monkeypatch.setenv("VLLM_LENS_FETCH_OVERLAP", "1")
    assert frontend_fetch._overlap_chunks(None, todo) == [todo]  # off
    monkeypatch.setenv("VLLM_LENS_FETCH_OVERLAP", "4")
    assert frontend_fetch._overlap_chunks(None, todo) == [todo]  # 80 items: one round trip's minimum, not two
    out, p, samples, ch = todo[0]
    captures = [(out, Pending(key="c", n=1, layers=[1], d_model=8, probes={}, prompt_len=5), samples, ch)]
    assert frontend_fetch._overlap_chunks(None, captures + todo * 4) == [captures + todo * 4]  # captures: never
