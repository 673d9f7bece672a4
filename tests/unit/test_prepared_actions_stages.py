"""`test_prepared_actions` on one pipeline stage's layers (review3): actions wholly on the other stage
(skipped by `prepare` as by `uses`), split over both (refused `unsupported` from a template as without),
gated steering whose vector or action lies elsewhere, and a table that fills up: the same tables, uses,
gates and errors, bit for bit, as admission without templates."""

from __future__ import annotations

import pytest
import torch

from tests.unit import test_prepared_actions as base
from tests.unit.test_admit_templates import SITES, D
from vllm_worker.worker import graph
from vllm_worker.worker.actions import ActionTable
from vllm_worker.worker.admission import Admission
from vllm_worker.worker.store import CaptureStore


def _make(kept: int, slots: int, layers: list[int]) -> Admission:
    sites = [SITES[l] for l in layers]
    g = graph.GraphTaps(sites, D, torch.bfloat16, torch.device("cpu"), 64, None)
    args = (base.Runner(base.N), torch.device("cpu"), torch.bfloat16, D, frozenset(sites), frozenset(layers), {}, True)
    adm = Admission(
        *args,
        None,
        CaptureStore(torch.device("cpu")),
        g,
        None,
        None,
        actions=ActionTable(D, torch.device("cpu"), n_slots=slots),
    )  # type: ignore[arg-type]
    adm.templates.kept = kept
    return adm


_BASE_STATE = base._state


def _state(adm: Admission, s) -> dict:
    out = _BASE_STATE(adm, s)
    never = adm.actions.never.data_ptr()  # (another table's: compared by name, not address)
    out["gates"] = [
        "never" if st.gate is not None and st.gate.data_ptr() == never else g for st, g in zip(s.steers, out["gates"])
    ]
    return out


@pytest.mark.parametrize("layers", [[0, 1], [1, 3], [3]])
def test_prepared_actions_on_one_stage_equal_per_request_admission(layers, monkeypatch):
    monkeypatch.setattr(base, "_state", _state)
    for slots in (64, 8):
        got_adm, want_adm = _make(8, slots, layers), _make(0, slots, layers)
        got, got_tables = base._run(got_adm)
        want, want_tables = base._run(want_adm)
        assert got == want
        for a, b in zip(got_tables, want_tables):
            base._same(a, b)
        assert any(t.prepared for t in got_adm.templates._memo.values())  # (the prepared path was taken)
        kinds = {s["error"][0] for s in got[0] if s["error"]}
        assert "unsupported" in kinds and ("limit" in kinds) == (slots == 8 and 1 in layers)
