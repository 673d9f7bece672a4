"""A probe action gates only steering entries its request holds (review3). After every step, each live
action copies its gate into the entries it gates (`ActionUse.entries`, `ActionTable.after_step`), so an
action left naming entries its request gave back wrote its gate into whatever request took them next:
with the action not fired (gate 0), another request's plain steering went off. `Admission._grouped` left
it so when a later group of the request did not fit the table (the request then takes the Python path,
its entries given back); the runtime when mlp_post work sends an admitted request to the Python path
(`runtime._free_entries`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_worker.api.steering import SteeringVector
from vllm_worker.frontend.validation import parse_request
from vllm_worker.protocol.points import OUT, site
from vllm_worker.protocol.spec import ModelShape, encode
from vllm_worker.worker import action_step, graph
from vllm_worker.worker.actions import ActionTable
from vllm_worker.worker.admission import Admission
from vllm_worker.worker.store import CaptureStore

D, LAYERS = 64, 4
SITES = [site(l, OUT) for l in range(LAYERS)]
SHAPE = ModelShape(n_layers=LAYERS, d_model=D)


class Runner:
    requests = {r: type("R", (), {"num_prompt_tokens": 7})() for r in ("x", "y")}


def _vec(seed: int) -> torch.Tensor:
    return torch.randn(D, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def adm(monkeypatch) -> Admission:
    esize = 2  # (bfloat16)
    monkeypatch.setenv("VLLM_LENS_STEER_MB", repr(3 * 2 * D * esize / (1 << 20)))  # a table of 3 entries
    g = graph.GraphTaps(SITES, D, torch.bfloat16, torch.device("cpu"), 64, None)
    assert g.entries.A.shape[0] == 3
    args = (Runner(), torch.device("cpu"), torch.bfloat16, D, frozenset(SITES), frozenset(range(LAYERS)), {}, True)
    table = ActionTable(D, torch.device("cpu"), n_slots=8)
    out = Admission(*args, None, CaptureStore(torch.device("cpu")), g, None, None, actions=table)  # type: ignore[arg-type]
    out.templates.kept = 0
    return out


def test_an_action_whose_request_gave_its_entries_back_gates_none(adm):
    # x: a vector gated by its action at layer 1 (1 entry: fits), then a plain one at layers 0, 2, 3 (3: do not)
    gated = SteeringVector(activations=_vec(1).view(1, D), layer_indices=[1], scale=2.0)
    act = {"direction": _vec(2).tolist(), "layer": 2, "threshold": 1e6, "then": {"steer": gated}}
    plain = SteeringVector(activations=_vec(3).expand(3, D).clone(), layer_indices=[0, 2, 3])
    spec_x = parse_request({"probe_actions": [act], "apply_steering_vectors": [plain]}, SHAPE, 7)
    assert spec_x is not None
    # (the gated steer first: its group is the first `_grouped` stores)
    spec_x.steers = [spec_x.steers[-1], *spec_x.steers[:-1]]
    x = adm.admit("x", encode(spec_x))
    assert x.entries is None and x.entry_ids == [] and len(x.acts) == 1  # (Python path: nothing held)
    # y: plain steering at layer 1, admitted next: the table's free entries are all there is
    spec_y = parse_request({"apply_steering_vectors": [SteeringVector(_vec(4).view(1, D), [1])]}, SHAPE, 7)
    y = adm.admit("y", encode(spec_y))
    adm.flush()
    assert y.entry_ids and float(adm.graph.entries.gate[y.entry_ids[0]]) == 1.0
    assert not set(x.acts[0].entries or ()) & set(y.entry_ids)  # x's action gates none of y's entries
    # a step of x (its action not fired: gate 0) leaves y's steering on
    rows = np.zeros(1, dtype=np.int64)
    step = action_step.make(adm.actions, {SITES[2]: (rows.copy(), rows, [(x, 0, 1)])}, graph=True)
    adm.actions.after_step(step.entries, adm.graph.entries.gate, None)
    assert float(adm.graph.entries.gate[y.entry_ids[0]]) == 1.0
