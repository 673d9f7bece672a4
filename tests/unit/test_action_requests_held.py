"""A request whose probe actions all lie on another pipeline stage holds nothing in this stage's action
table: `ActionTable.uses` / `uses_prepared` registered it with an empty list, which no leave ever gave back
(the runtime frees only requests with uses), so `action_requests` in `lens_status` grew by one per such
request for the worker's life (review3). With templates and without; a stage holding the action still
counts the request until it leaves."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_worker.api.steering import SteeringVector
from vllm_worker.frontend.validation import parse_request
from vllm_worker.protocol.points import OUT, site
from vllm_worker.protocol.spec import ModelShape, encode
from vllm_worker.worker import graph
from vllm_worker.worker.actions import ActionTable
from vllm_worker.worker.admission import Admission
from vllm_worker.worker.store import CaptureStore

D, LAYERS, N = 64, 4, 6


def _stage(layers: list[int], kept: int) -> Admission:
    """One pipeline stage holding `layers` (the other stage holds the rest)."""
    sites = [site(l, OUT) for l in layers]
    g = graph.GraphTaps(sites, D, torch.bfloat16, torch.device("cpu"), 64, None)
    runner = types.SimpleNamespace(requests={f"r{i}": types.SimpleNamespace(num_prompt_tokens=7) for i in range(N)})
    args = (runner, torch.device("cpu"), torch.bfloat16, D, frozenset(sites), frozenset(layers), {}, True)
    adm = Admission(
        *args, None, CaptureStore(torch.device("cpu")), g, None, None, actions=ActionTable(D, torch.device("cpu"), 16)
    )  # type: ignore[arg-type]
    adm.templates.kept = kept
    return adm


def _payload() -> dict:
    u = torch.nn.functional.normalize(torch.randn(D, generator=torch.Generator().manual_seed(0)), dim=0)
    steer = SteeringVector(activations=u.view(1, D).clone(), layer_indices=[3], scale=2.0)
    act = {"direction": u.tolist(), "layer": 3, "threshold": 0.5, "then": {"steer": steer}}
    spec = parse_request({"probe_actions": [act]}, ModelShape(n_layers=LAYERS, d_model=D), 7)
    assert spec is not None
    return encode(spec)


@pytest.mark.parametrize("kept", [0, 8])
def test_a_stage_without_the_actions_layer_holds_nothing_for_the_request(kept):
    first, last = _stage([0, 1], kept), _stage([2, 3], kept)
    for i in range(N):
        for adm in (first, last):
            state = adm.admit(f"r{i}", _payload())
            assert state.store is None or state.store.error is None
        first.flush()
        last.flush()
    assert first.actions.status() == {"action_slots": 0, "action_requests": 0, "action_stops": 0}
    assert last.actions.status() == {"action_slots": N, "action_requests": N, "action_stops": 0}
    assert kept == 0 or first.templates.hits == last.templates.hits == N - 2  # (the template path ran)
