"""How many objects Python's garbage collector tracks for a probe fetch of W10's shape (8 probes, 2 a site at
4 sites, every request): the worker's payload (as built, and as the frontend decodes it from the engine's
msgspec RPC) and what the frontend keeps on the outputs after decoding. A full collection walks every
tracked object of the frontend process, and each object a fetch keeps alive through two young collections
counts towards triggering one (docs/decisions.md, tailgc) — so these are bounds, not timings: a change that
puts containers back per request and probe fails here."""

from __future__ import annotations

import gc
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import torch
from vllm.outputs import CompletionOutput, RequestOutput

from vllm_worker.frontend import fetch as frontend_fetch
from vllm_worker.frontend import probes as frontend_probes
from vllm_worker.frontend.state import Pending
from vllm_worker.protocol.spec import PROBE_SCORES_KEY, RequestSpec
from vllm_worker.protocol.wire import tensor_to_bytes
from vllm_worker.worker import fetch, probes
from vllm_worker.worker.request_results import RequestResults

D, SITES, PROMPT, STEPS, N_REQ = 8, (1, 2, 3, 4), 5, 12, 48
AGGREGATES = ["mean", "max", "last"]


def _filed() -> list[SimpleNamespace]:
    """`N_REQ` requests scoring 8 probes (2 a site), filed as the engine does: a prefill, then decode steps."""
    g = torch.Generator().manual_seed(7)
    wp = probes.WorkerProbes(torch.device("cpu"), frozenset(range(8)))
    for j in range(8):
        w = tensor_to_bytes(torch.randn(1, D, generator=g))
        wp.load(f"m{j}", f"u{j}", {"layers": [SITES[j // 2]], "point": "resid_post", "output": "logit", "weight": w})
    uses = wp.uses([{"probe": f"m{j}", "uid": f"u{j}"} for j in range(8)])
    sites = sorted({s for u in uses for s in u.weights})
    reqs = [SimpleNamespace(probes=uses, sae=[], store=RequestResults([])) for _ in range(N_REQ)]
    col = {s: i for i, s in enumerate(sites)}
    for width, steps in ((PROMPT, 1), (1, STEPS)):
        e = np.zeros(0, dtype=np.int64)
        gp = SimpleNamespace(n=N_REQ * width, cap_rows=e, cap_cols=e, n_extra=0, probes={}, sae={})
        items = [(r, i * width, (i + 1) * width) for i, r in enumerate(reqs)]
        rows = lambda it: np.concatenate([np.arange(a, b) for _, a, b in it])  # noqa: E731
        probes.stage_probes(gp, {s: list(items) for s in sites}, col, rows)
        gp.total = len(gp.cap_rows)
        for k in range(steps):
            pos = np.tile(np.arange(PROMPT), N_REQ) if width > 1 else np.full(N_REQ, PROMPT + k, dtype=np.int64)
            probes.scores_from_stage(gp, torch.randn(gp.total, D, generator=g), 0, pos)
    return reqs


def _tracked(obj: Any) -> int:
    """Tracked objects reachable from `obj` through dicts, lists and tuples (the payload's containers)."""
    n = int(gc.is_tracked(obj))
    if isinstance(obj, dict):
        return n + sum(_tracked(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return n + sum(_tracked(v) for v in obj)
    return n


def test_a_probe_fetch_payload_tracks_a_few_objects_a_request_not_a_few_a_probe():
    reqs = _filed()
    parts = fetch.assemble_all([(None, None, r.store, PROMPT + STEPS) for r in reqs], [], None, None)
    assert all(len(p["probes"]) == 8 for p in parts)
    over_rpc = msgspec.msgpack.decode(msgspec.msgpack.encode(parts))  # as the frontend gets it from an engine core
    for got in (parts, over_rpc):
        assert _tracked(got) <= 1 + 2 * N_REQ  # the list, each part and its probes dict; no probe's own
        assert all(not gc.is_tracked(item) for p in got for item in p["probes"].values())


def test_decoding_keeps_only_what_callers_get():
    reqs = _filed()
    wanted = {f"m{j}": {"aggregate": AGGREGATES, "positions": "generated"} for j in range(8)}
    parts = fetch.assemble_all([(None, None, r.store, PROMPT + STEPS) for r in reqs], [], None, None)
    fetched = {f"k{i}": {0: [part]} for i, part in enumerate(msgspec.msgpack.decode(msgspec.msgpack.encode(parts)))}
    todo = []
    for i in range(N_REQ):
        c = CompletionOutput(0, "", list(range(STEPS)), None, None)
        out = RequestOutput(f"r{i}", None, list(range(PROMPT)), None, [c], True)
        todo.append(
            (out, Pending(f"k{i}", 1, [], D, probes=wanted, prompt_len=PROMPT), {0: c}, {0: PROMPT + STEPS - 1})
        )
    gc.collect()
    before = {id(o) for o in gc.get_objects()}
    assert not frontend_fetch._apply(todo, fetched)
    del fetched, parts
    gc.collect()
    kept = [o for o in gc.get_objects() if id(o) not in before]
    # per sample: activations, probe_scores and probe_aggregates dicts; per probe its scores tensor, its
    # aggregates dict and one tensor per aggregate; the one tensor its scores are views of; the attribute
    # dicts of its RequestOutput and CompletionOutput (made by setting `activations`) — nothing per probe
    # beyond what callers get, no payload left over
    per_sample = 3 + 8 * (2 + len(AGGREGATES)) + 1 + 2
    assert len(kept) <= N_REQ * per_sample + 16, len(kept) - N_REQ * per_sample
    acts = todo[3][0].activations
    assert acts["probe_scores"]["m5"].shape == (PROMPT + STEPS, 1)
    assert set(acts["probe_aggregates"]["m5"]) == set(AGGREGATES)


def _parsed(ask: Any) -> RequestSpec:
    registry = {
        f"m{j}": SimpleNamespace(uid=f"u{j}", probe=SimpleNamespace(aggregate=[], output="logit")) for j in range(3)
    }
    spec = RequestSpec(key="k")
    frontend_probes.parse({PROBE_SCORES_KEY: ask}, spec, registry)
    return spec


def test_requests_asking_the_same_probe_outputs_share_one_read_only_object():
    """A pending request holds its probe options until it finishes (W10: a dict and a list per probe); equal
    asks share one object, other asks keep theirs, and explicit positions are never shared."""
    a, b = _parsed(["m0", "m1"]), _parsed(["m0", "m1"])
    assert a.probe_outputs is b.probe_outputs and a.probe_outputs == {
        f"m{j}": {"aggregate": ["mean", "max", "last"], "positions": "generated", "output": "logit"} for j in (0, 1)
    }
    assert a.probes is not b.probes  # (the workers' payload stays the request's own)
    other = _parsed({"m0": {"aggregate": ["ema:0.5"]}, "m1": {}})
    assert other.probe_outputs is not a.probe_outputs and other.probe_outputs["m0"]["aggregate"][-1] == "ema:0.5"
    assert _parsed(["m1", "m0"]).probe_outputs is not a.probe_outputs  # (order: the order results come in)
    c, d = (_parsed({"m0": {"positions": [0, 3]}}) for _ in range(2))
    assert c.probe_outputs is not d.probe_outputs and c.probe_outputs["m0"]["positions"] == [0, 3]
