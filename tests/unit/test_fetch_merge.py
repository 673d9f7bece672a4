"""The frontend's fetch loop on its own (no engine): answers of several RPC round trips and ranks merge into
one result per request — a pipeline stage's parts in rank order, an error beside them — the same whether
the first round trip is the only one or not."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_worker.frontend import fetch
from vllm_worker.frontend.state import Pending
from vllm_worker.transport import shm


def _drive(todo: list, answers: dict) -> tuple[dict, list]:
    rounds = fetch._fetch_rounds(SimpleNamespace(), todo)
    calls = []
    try:
        call = next(rounds)
        while True:
            calls.append([key for key, _ in call[2]])
            call = rounds.send(_ranks(answers, call[2]))
    except StopIteration as done:
        return done.value, calls


def _ranks(answers: dict, group: list) -> list:
    """Two ranks (pipeline stages): each answers its own part for every request of the round trip."""
    return [{key: answers[key][rank] for key, _ in group} for rank in range(2)]


def test_round_trips_and_ranks_merge_per_request(monkeypatch):
    monkeypatch.setattr(shm, "host_id", lambda: None)  # results inside the RPC reply: groups by size
    monkeypatch.setattr(fetch, "FETCH_GROUP_BYTES", 1)  # one request per round trip
    todo = [(Pending(f"k{i}", 1, [0, 1], 8), {0: 3}) for i in range(3)]
    err = {"kind": "internal", "message": "boom", "stage": "fetch"}
    answers = {
        "k0": [{0: {"layers": [0]}}, {0: {"layers": [1]}}],
        "k1": [{"error": err}, {0: {"layers": [1]}}],
        "k2": [{0: {"layers": [0]}}, {0: {"layers": [1]}}],
    }
    merged, calls = _drive(todo, answers)
    assert calls == [["k0"], ["k1"], ["k2"]]
    assert merged == {
        "k0": {0: [{"layers": [0]}, {"layers": [1]}]},
        "k1": {"error": err, 0: [{"layers": [1]}]},
        "k2": {0: [{"layers": [0]}, {"layers": [1]}]},
    }
    monkeypatch.setattr(fetch, "FETCH_GROUP_BYTES", 1 << 30)  # all in one round trip: the same merge
    assert _drive(todo, answers) == (merged, [["k0", "k1", "k2"]])
