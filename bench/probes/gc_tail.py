"""W10's result tail and the frontend's garbage collector, on CPU without an engine: how many gc-tracked
objects the frontend's decoding of a W10 fetch (`frontend.fetch._apply`: 256 requests x 8 probes) creates,
how many of them outlive it (on the outputs), how many the worker's payloads hold (they reach the frontend
as an RPC reply), the collections that decoding triggers, and what one full (generation-2) collection costs
with the frontend's heap padded to `HEAP` tracked objects (the H200 frontend holds ~790k), frozen or not
(`gc.freeze`, as vLLM's own servers and `vllm bench serve` do). The padding is plain dicts and lists: a
collection's cost is per tracked object traversed, so the figure is the shape, not the H200's. Prints one
JSON line.

    python bench/probes/gc_tail.py [requests] [probes] [heap]
"""

from __future__ import annotations

import gc
import json
import sys
import time

import msgspec
from result_tail import PROMPT, STEPS, _filed, _outputs  # (bench/probes: beside this script)

from vllm_worker.frontend import fetch as frontend_fetch
from vllm_worker.worker import fetch

HEAP = 790_000
ROUNDS = 40


class Collections:
    """Collections per generation and their seconds while installed (`gc.callbacks`)."""

    def __init__(self) -> None:
        self.n = [0, 0, 0]
        self.s = [0.0, 0.0, 0.0]
        self._t = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            g = info["generation"]
            self.n[g] += 1
            self.s[g] += time.perf_counter() - self._t


def _tracked_ids() -> set[int]:
    return {id(o) for o in gc.get_objects()}


def _pad(n: int) -> list:
    """About `n` tracked objects: a dict, a list and a tuple per three (a frontend's heap of module state)."""
    return [({"k": i}, [i], (i, [])) for i in range(n // 4)]


def _full_s(repeats: int = 3) -> float:
    best = 1e9
    for _ in range(repeats):
        t = time.perf_counter()
        gc.collect()
        best = min(best, time.perf_counter() - t)
    return best


def _rounds(todo: list, wanted: dict, n_req: int) -> dict:
    """`ROUNDS` W10 tails in the padded heap as an offline frontend runs them: the reply decoded from the
    engine's msgspec bytes, decoded onto fresh outputs that live until the next round's (a caller holding a
    run's outputs). Full collections counted over them; vLLM's own per-request objects are left out, so
    this is this project's share of what triggers them, not the H200's rate."""
    reply = msgspec.msgpack.encode(fetch.assemble_all(todo, [], None, None))
    clock = Collections()
    gc.collect()
    gc.callbacks.append(clock)
    held = None
    t = time.perf_counter()
    for _ in range(ROUNDS):
        outs = _outputs(n_req, wanted)
        frontend_fetch._apply(outs, {f"r{i}": {0: [part]} for i, part in enumerate(msgspec.msgpack.decode(reply))})
        held = outs
    wall = time.perf_counter() - t
    gc.callbacks.remove(clock)
    del held
    return {
        "rounds": ROUNDS,
        "rounds_collections": clock.n,
        "rounds_full_s": round(clock.s[2], 3),
        "rounds_wall_s": round(wall, 3),
    }


def main(n_req: int, n_probes: int, heap: int) -> dict:
    reqs = _filed(n_req, n_probes)
    wanted = {f"m8_{j}": {"aggregate": ["mean", "max", "last"], "positions": "generated"} for j in range(n_probes)}
    todo = [(None, None, r.store, PROMPT + STEPS) for r in reqs]
    gc.collect()
    before = _tracked_ids()
    got = fetch.assemble_all(todo, [], None, None)
    payload_objects = len(_tracked_ids() - before)  # the reply's dicts: what the frontend decodes from the RPC
    before = _tracked_ids()
    over_rpc = msgspec.msgpack.decode(msgspec.msgpack.encode(got))  # as an engine core's reply is decoded
    rpc_objects = len(_tracked_ids() - before) - 1  # (less `before` itself)
    del over_rpc
    outs = _outputs(n_req, wanted)
    fetched = {f"r{i}": {0: [part]} for i, part in enumerate(got)}
    gc.collect()
    before = _tracked_ids()
    gc.disable()
    c0 = gc.get_count()[0]
    assert not frontend_fetch._apply(outs, fetched)
    net = gc.get_count()[0] - c0  # tracked allocations minus deallocations during the decoding
    gc.enable()
    del fetched, got
    gc.collect()
    kept = len(_tracked_ids() - before)  # what the outputs hold afterwards
    # decoding's collections, in a process with nothing else: gen0 / gen1 triggered
    clock = Collections()
    gc.callbacks.append(clock)
    outs2 = _outputs(n_req, wanted)
    fetched = {f"r{i}": {0: [part]} for i, part in enumerate(fetch.assemble_all(todo, [], None, None))}
    t = time.perf_counter()
    frontend_fetch._apply(outs2, fetched)
    apply_s = time.perf_counter() - t
    gc.callbacks.remove(clock)
    del fetched, outs2
    pad = _pad(heap - len(gc.get_objects()))
    gc.collect()
    tracked = len(gc.get_objects())
    full = _full_s()
    gc.freeze()
    full_frozen = _full_s()
    gc.unfreeze()
    rounds = _rounds(todo, wanted, n_req)
    del pad
    return {
        "requests": n_req,
        "probes": n_probes,
        "payload_tracked_objects": payload_objects,
        "payload_per_request": round(payload_objects / n_req, 1),
        "payload_over_rpc_tracked_objects": rpc_objects,
        "apply_net_tracked": net,
        "apply_kept_tracked": kept,
        "kept_per_request": round(kept / n_req, 1),
        "apply_s": round(apply_s, 4),
        "apply_collections": clock.n,
        "apply_collection_s": [round(x, 4) for x in clock.s],
        "heap_tracked": tracked,
        "full_collection_s": round(full, 4),
        "full_collection_frozen_s": round(full_frozen, 4),
        **rounds,
    }


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:4]]
    print(json.dumps(main(*(args + [256, 8, HEAP][len(args) :]))))
