"""An admission template covers payloads whose tensors total at most `admit_templates.MAX_BYTES` as
admission expands them: a steer whose equal rows crossed as one row and a count (rowrep) counts every row,
as its template's host copies hold them (`Template.host`). Counted as sent, a 3-D patch of equal blocks at
8 layers (20 MB of rows, one 2.4 MB block sent) got a template pinning its 20 MB of host rows, 8 of them
kept per worker, past the bound the templates document (review3). A repeated and a dense payload of the
same rows are covered alike; W12's shape (32 layers x 4096 floats, 512 KB) still is."""

from __future__ import annotations

import types

import torch

from vllm_worker.api.steering import SteeringVector
from vllm_worker.frontend.validation import parse_request
from vllm_worker.protocol.points import OUT, site
from vllm_worker.protocol.spec import ModelShape, encode
from vllm_worker.worker import admit_templates, graph
from vllm_worker.worker.admission import Admission
from vllm_worker.worker.store import CaptureStore


def _payloads(layers: int, d: int, n_pos: int | None) -> tuple[dict, dict]:
    """(repeated, dense) payloads of one steer whose rows are all equal."""
    g = torch.Generator().manual_seed(0)
    block = torch.randn(d, generator=g) if n_pos is None else torch.randn(n_pos, d, generator=g)
    extra = {} if n_pos is None else {"position_indices": list(range(n_pos))}
    sv = SteeringVector(
        activations=block.expand(layers, *block.shape).clone(), layer_indices=list(range(layers)), **extra
    )
    spec = parse_request({"apply_steering_vectors": [sv]}, ModelShape(n_layers=layers, d_model=d), (n_pos or 1) + 1)
    assert spec is not None and spec.steers[0].repeat == layers
    rep = encode(spec)
    spec.steers[0].raw = None
    return rep, encode(spec)


def test_a_repeated_steer_counts_every_row_against_the_templates_bound():
    rep, dense = _payloads(8, 1024, 600)  # (one block 2.4 MB, every row 19.7 MB)
    assert len(rep["steer"][0]["vec"]["data"]) <= admit_templates.MAX_BYTES < len(dense["steer"][0]["vec"]["data"])
    assert admit_templates.split(rep) is None and admit_templates.split(dense) is None
    rep, dense = _payloads(32, 4096, None)  # (W12: 512 KB of rows)
    assert admit_templates.split(rep) is not None and admit_templates.split(dense) is not None


def test_no_template_holds_rows_past_the_bound():
    layers, d = 8, 1024
    sites = [site(l, OUT) for l in range(layers)]
    g = graph.GraphTaps(sites, d, torch.float32, torch.device("cpu"), 64, None)
    runner = types.SimpleNamespace(requests={f"r{i}": types.SimpleNamespace(num_prompt_tokens=700) for i in range(4)})
    args = (runner, torch.device("cpu"), torch.float32, d, frozenset(sites), frozenset(range(layers)), {}, True)
    adm = Admission(*args, None, CaptureStore(torch.device("cpu")), g, None, None)  # type: ignore[arg-type]
    rep, _ = _payloads(layers, d, 600)
    states = [adm.admit(f"r{i}", rep) for i in range(4)]
    adm.flush()
    assert all(s.store is None or s.store.error is None for s in states)
    held = sum(t.numel() * t.element_size() for tm in adm.templates._memo.values() for t in tm.host)
    assert held <= 4 * admit_templates.MAX_BYTES, held  # (the bound `admit_templates` documents; 19.7 MB before)
