"""`fetch.assemble_all` of many requests reads each step record to the host once for all of them
(`fetch.shared_records`); every request's probe scores and SAE features are bit-identical to a fetch of
that request alone — with requests of different lengths (compositions changing as requests finish
mid-batch, so a request's rows span several records), a position filed twice, and a failed request among
them (its error, no scores)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from support.filing import file_steps
from vllm_worker.protocol import probe_wire
from vllm_worker.protocol.wire import tensor_from_bytes, tensor_to_bytes
from vllm_worker.sae import Sae
from vllm_worker.worker import fetch, probes, saes
from vllm_worker.worker.request_results import RequestResults
from vllm_worker.worker.step_records import latest

D, D_SAE, LAYERS = 16, 32, (1, 3)


def _gp(n: int) -> SimpleNamespace:
    e = np.zeros(0, dtype=np.int64)
    return SimpleNamespace(n=n, cap_rows=e, cap_cols=e, n_extra=0, probes={}, sae={})


def _requests(n_req: int) -> list[SimpleNamespace]:
    g = torch.Generator().manual_seed(3)
    wp = probes.WorkerProbes(torch.device("cpu"), frozenset(range(4)))
    for j, layers in enumerate([[1], [1, 3], [3]]):
        wire = {"layers": layers, "point": "resid_post", "output": "sigmoid" if j == 1 else "logit"}
        w = torch.randn(2, D * len(layers), generator=g)
        wp.load(f"p{j}", f"u{j}", {**wire, "weight": tensor_to_bytes(w)})
    uses = wp.uses([{"probe": f"p{j}", "uid": f"u{j}"} for j in range(3)])
    sae = Sae("resid_post", 1, "standard", torch.randn(D, D_SAE, generator=g), torch.zeros(D_SAE) - 0.1,
              torch.randn(D_SAE, D, generator=g), torch.zeros(D))  # fmt: skip
    sites = sorted({s for u in uses for s in u.weights})
    return [
        SimpleNamespace(probes=uses, sae=[saes.SaeUse("s", sae, sites[0], 4)], store=RequestResults([]), sites=sites)
        for _ in range(n_req)
    ]


def _stage(reqs: list, live: list[int], width: int) -> SimpleNamespace:
    """A composition of the `live` requests, `width` rows each."""
    sites = reqs[0].sites
    col = {s: i for i, s in enumerate(sites)}
    items = [(reqs[r], i * width, (i + 1) * width) for i, r in enumerate(live)]
    gp = _gp(len(live) * width)
    rows = lambda it: np.concatenate([np.arange(a, b) for _, a, b in it])  # noqa: E731
    probes.stage_probes(gp, {s: list(items) for s in sites}, col, rows)
    saes.stage_features(gp, {}, {sites[0]: list(items)}, col)
    gp.total = len(gp.cap_rows)
    return gp


def _file(gp: SimpleNamespace, pos: np.ndarray, g: torch.Generator) -> None:
    stage = torch.randn(gp.total, D, generator=g)
    probes.scores_from_stage(gp, stage, 0, pos)
    saes.features_from_stage(gp, stage, 0, pos)


def _run(reqs: list[SimpleNamespace], lengths: list[int], g: torch.Generator) -> None:
    """A prefill of positions 0, 1 (two rows a request), then decode steps; position 5 of every request is
    filed twice (the second run wins)."""
    file_steps(lambda live, rows: _stage(reqs, live, rows), lambda gp, pos: _file(gp, pos, g), lengths, 2, (6, 5))


def test_one_fetch_of_many_matches_each_alone():
    lengths = [3, 9, 9, 20, 7, 70, 2, 20]
    reqs = _requests(len(lengths))
    _run(reqs, lengths, torch.Generator().manual_seed(4))
    reqs[4].store.error = {"kind": "hook", "message": "failed"}
    todo = [(None, None, r.store, n) for r, n in zip(reqs, lengths)]
    together = fetch.assemble_all(todo, [], None, None)
    assert fetch.shared_records(len(todo)) is not None and fetch.shared_records(1) is None
    for i, (r, n) in enumerate(zip(reqs, lengths)):
        (alone,) = fetch.assemble_all([todo[i]], [], None, None)
        assert together[i] == alone
        if i == 4:
            assert "probes" not in alone and alone["error"]["kind"] == "hook"
            continue
        assert set(alone["probes"]) == {"p0", "p1", "p2"} and set(alone["sae"]) == {"s"}
        want = sorted({k if k != 6 else 5 for k in range(n)})
        for j in ("p0", "p1", "p2"):
            assert probe_wire.arrays(alone["probes"][j], j)[0].tolist() == want
        assert tensor_from_bytes(alone["sae"]["s"]["positions"]).tolist() == want


def test_latest_of_one_piece_sorts_when_positions_do_not_rise():
    pos = torch.tensor([0, 1, 2, 2, 3])
    vals = torch.arange(10.0).reshape(5, 2)
    p, v = latest([(pos, vals)])
    assert p.tolist() == [0, 1, 2, 3] and torch.equal(v, vals[[0, 1, 3, 4]])
    p, v = latest([(pos[[0, 1, 2, 4]], vals[[0, 1, 2, 4]])])
    assert p.tolist() == [0, 1, 2, 3] and torch.equal(v, vals[[0, 1, 2, 4]])


def test_latest_of_rising_pieces_joins_them_as_they_are():
    vals = torch.arange(12.0).reshape(6, 2)
    p, v = latest(
        [(torch.tensor([0, 1, 2]), vals[:3]), (torch.tensor([3]), vals[3:4]), (torch.tensor([4, 5]), vals[4:])]
    )
    assert p.tolist() == list(range(6)) and torch.equal(v, vals)
    p, v = latest([(torch.tensor([3, 4]), vals[:2]), (torch.tensor([0, 1, 2]), vals[2:5])])  # out of order
    assert p.tolist() == [0, 1, 2, 3, 4] and torch.equal(v, vals[[2, 3, 4, 0, 1]])
