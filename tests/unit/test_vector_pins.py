"""Named vectors by reference, without an engine: the registry's pins (a replaced or deleted registration
is dropped only once no request in flight names it), and the worker's side (a reference made back into
the bytes the frontend would have sent; vLLM's payload never edited; an unknown reference an error)."""

import copy

import pytest
import torch

from vllm_worker.frontend import vector_refs
from vllm_worker.frontend.vectors import VectorRegistry
from vllm_worker.protocol.spec import VECTOR_DROPS_KEY as DROPS_KEY
from vllm_worker.protocol.spec import decode
from vllm_worker.worker.vector_refs import HeldVectors

D = 1024


def _held(registry: VectorRegistry, name: str, t: torch.Tensor):
    registry.register("", name, t)
    entry = registry.entry("", name, "name")
    held = vector_refs.forms(entry)
    registry.held(entry, held)
    return entry, held


def test_pins_keep_a_replaced_or_deleted_registration_until_unpinned():
    reg = VectorRegistry()
    a, _ = _held(reg, "v", torch.randn(D))
    assert reg.pin([a.vid]) and reg.pin([a.vid])  # two requests in flight name it
    b, _ = _held(reg, "v", torch.randn(D))  # replaced: `a` retired, still pinned
    assert reg.take_drops() == [] and reg.entry("", "v", "name") is b
    reg.unpin((a.vid,))
    assert reg.take_drops() == []
    assert not reg.pin(["unknown"])
    reg.unpin((a.vid,))
    assert reg.take_drops() == [a.vid] and reg.take_drops() == []
    assert not reg.pin([a.vid])  # dropped: a request resolving it now would carry bytes
    assert reg.delete("", "v") and reg.take_drops() == [b.vid]  # unpinned: dropped at once


def test_a_registration_replaced_while_pushing_is_dropped():
    reg = VectorRegistry()
    reg.register("", "v", torch.randn(D))
    old = reg.entry("", "v", "name")
    reg.register("", "v", torch.randn(D))
    reg.held(old, vector_refs.forms(old))  # its push returned after the replacement
    assert reg.take_drops() == [old.vid] and not reg.pin([old.vid])


def test_the_worker_makes_references_back_into_bytes():
    t = torch.randn(D) * 3
    reg = VectorRegistry()
    entry, held = _held(reg, "v", t)
    worker = HeldVectors()
    assert worker.put([held.wire(entry.vid)], []) == 1
    payload = {
        "v": 1,
        "key": "k",
        "capture": [],
        "steer": [
            {"layers": [1, 2, 3], "vec": {"ref": entry.vid, "unit": True, "repeat": 3}, "positions": None,
             "scale": 1.0, "norm_match": False, "op": 1, "lo": None, "hi": None, "span": None, "cols": None},
        ],
        DROPS_KEY: ["gone"],
    }  # fmt: skip
    before = copy.deepcopy(payload)
    out = worker.resolve(payload)
    assert payload == before and DROPS_KEY not in out  # vLLM's payload untouched
    rows = decode(out).steers[0].vectors
    unit = (t / t.norm()).expand(3, D)
    assert rows.shape == (3, D) and torch.allclose(rows, unit, atol=1e-7)
    assert rows.numpy().tobytes() == held.unit * 3  # exactly the pushed rows, repeated
    assert out["steer"][0]["vec"]["data"] is worker.resolve(payload)["steer"][0]["vec"]["data"]  # one bytes object
    worker.put([], [entry.vid])
    with pytest.raises(LookupError, match=f"steering vector {entry.vid} is not held"):
        worker.resolve(payload)
    plain = {"v": 1, "key": "k", "capture": []}
    assert worker.resolve(plain) is plain


def test_a_retired_registration_counts_against_the_limit_while_pinned(monkeypatch):
    monkeypatch.setenv("VLLM_LENS_MAX_VECTORS_MB", str(3.5 * D * 4 / 1e6))  # room for three vectors, not four
    reg = VectorRegistry()
    a, _ = _held(reg, "v", torch.randn(D))
    assert reg.pin([a.vid])  # a request in flight names it: the workers keep it
    _held(reg, "v", torch.randn(D))  # replaced: both count
    assert reg.nbytes == 2 * D * 4
    _held(reg, "w", torch.randn(D))
    with pytest.raises(ValueError, match="VLLM_LENS_MAX_VECTORS_MB"):
        reg.register("", "x", torch.randn(D))
    reg.unpin((a.vid,))  # the request finished: the old rows go, and so does their count
    assert reg.nbytes == 2 * D * 4 and reg.take_drops() == [a.vid]
    reg.register("", "x", torch.randn(D))
    assert reg.delete("", "x") and reg.nbytes == 2 * D * 4  # never pushed, never pinned: at once


def test_drops_sent_with_requests_go_again_with_the_next_push():
    """A request carrying drops may never reach the workers (aborted while queued): every push re-sends the
    drops not yet sent with one, until a push succeeds."""
    reg = VectorRegistry()
    a, _ = _held(reg, "a", torch.randn(D))
    b, _ = _held(reg, "b", torch.randn(D))
    assert reg.delete("", "a") and reg.take_drops() == [a.vid]  # rode a request's payload
    assert reg.delete("", "b")
    first = reg.push_drops()
    assert first == [a.vid, b.vid]  # the push failed: nothing confirmed
    assert reg.take_drops() == [] and reg.push_drops() == [a.vid, b.vid]
    reg.pushed([a.vid, b.vid])
    assert reg.push_drops() == [] and reg.take_drops() == []


def test_the_worker_forgets_a_payloads_drops_even_when_its_reference_fails():
    reg = VectorRegistry()
    entry, held = _held(reg, "v", torch.randn(D))
    worker = HeldVectors()
    worker.put([held.wire(entry.vid)], [])
    payload = {
        "v": 1, "key": "k", "capture": [],
        "steer": [{"layers": [0], "vec": {"ref": "unknown", "unit": False, "repeat": 1}, "positions": None,
                   "scale": 1.0, "norm_match": False}],
        DROPS_KEY: [entry.vid],
    }  # fmt: skip
    with pytest.raises(LookupError):
        worker.resolve(payload)
    assert worker.count() == 0


def test_the_worker_reads_steers_only_of_a_payload_the_frontend_marked():
    """`VECTOR_REFS_KEY` (set by `frontend.vector_refs.by_reference` with every reference it sends) is what makes the
    worker look at a payload's steers: marked, the references are made bytes and the mark goes; unmarked, the
    payload is handed on as it is (most name no vector: no scan of their steers per request)."""
    from vllm_worker.protocol.spec import VECTOR_REFS_KEY as REFS_KEY

    reg = VectorRegistry()
    entry, held = _held(reg, "v", torch.randn(D))
    worker = HeldVectors()
    worker.put([held.wire(entry.vid)], [])
    steer = {"layers": [0], "vec": {"ref": entry.vid, "unit": False, "repeat": 2}, "positions": None, "scale": 1.0,
             "norm_match": False}  # fmt: skip
    marked = {"v": 1, "key": "k", "capture": [], "steer": [steer], REFS_KEY: 1}
    before = copy.deepcopy(marked)
    out = worker.resolve(marked)
    assert marked == before and REFS_KEY not in out and out["steer"][0]["vec"]["data"] == held.plain * 2
    assert worker.resolved == 1 and decode(out).steers[0].vectors.shape == (2, D)
    inline = {"v": 1, "key": "k", "capture": [], "steer": [{**steer, "vec": out["steer"][0]["vec"]}]}
    assert worker.resolve(inline) is inline and worker.resolved == 1
    unmarked = {k: v for k, v in marked.items() if k != REFS_KEY}  # (a payload the frontend never makes)
    assert worker.resolve(unmarked) is unmarked
    drops_only = {"v": 1, "key": "k", "capture": [], DROPS_KEY: [entry.vid]}
    assert worker.resolve(drops_only) == {"v": 1, "key": "k", "capture": []} and worker.count() == 0
