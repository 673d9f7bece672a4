"""A fetch's group of requests with the same probes in the same order gets one block a request in one pass
(`probe_payloads._blocks` through `probe_wire.pack_blocks`): the same blocks, byte for byte, as one
`pack_block` per request; a group where some request lists its probes in another order, or whose members are
not request after request, keeps the per-request walk (blocks where they fit, items elsewhere)."""

from __future__ import annotations

import numpy as np

from vllm_worker.protocol import probe_wire
from vllm_worker.worker import probe_payloads

K_OUT, ROWS = 2, 7
ROW_VALS = ROWS * K_OUT * 4  # bytes of a member's scores
POS = np.arange(ROWS, dtype=np.int64).tobytes()


def _flat(n_members: int) -> bytes:
    return np.random.default_rng(n_members).standard_normal(n_members * ROWS * K_OUT).astype(np.float32).tobytes()


def _run(members: list, order: list) -> list:
    done: list = [{} for _ in order]
    flat = _flat(len(members))
    probe_payloads._blocks(members, order, POS, flat, ROW_VALS, K_OUT, done)
    return done


def test_a_regular_group_gets_each_requests_block_as_pack_block_makes_it():
    names = ["a", "d", "c"]
    reqs = [4, 0, 2, 1]
    order: list = [None] * 5
    for i in reqs:
        order[i] = names
    members = [(i, name, None, None, None) for i in reqs for name in names]
    done = _run(members, order)
    flat = _flat(len(members))
    size = len(names) * ROW_VALS
    for r, i in enumerate(reqs):
        want = probe_wire.pack_block(POS, flat[r * size : (r + 1) * size], names, K_OUT)
        assert done[i] == want and list(done[i][0]) == names
    assert done[3] == {}
    # each block's `{name: n_out}` its own (a caller changing one changes no other)
    assert len({id(done[i][0]) for i in reqs}) == len(reqs)
    items = [probe_wire.items_of({"probes": d[0], probe_wire.BLOCK: d[1]}) for d in (done[i] for i in reqs)]
    assert [list(it) for it in items] == [names] * len(reqs)


def test_a_request_in_another_order_keeps_the_walk():
    names = ["a", "d"]
    order: list = [names, ["d", "a"], names]
    members = [(0, "a", None, None, None), (0, "d", None, None, None)]
    members += [(1, "d", None, None, None), (1, "a", None, None, None)]
    members += [(2, "a", None, None, None), (2, "d", None, None, None)]
    done = _run(members, order)
    flat = _flat(len(members))
    for r, i in enumerate(range(3)):
        want = probe_wire.pack_block(POS, flat[2 * r * ROW_VALS : 2 * (r + 1) * ROW_VALS], order[i], K_OUT)
        assert done[i] == want and list(done[i][0]) == order[i]


def test_members_not_request_after_request_become_items():
    names = ["a", "d"]
    order: list = [names, names]
    members = [(0, "a", None, None, None), (1, "a", None, None, None)]
    members += [(0, "d", None, None, None), (1, "d", None, None, None)]
    done = _run(members, order)
    flat = _flat(len(members))
    for k, (i, name, *_) in enumerate(members):
        assert done[i][name] == probe_wire.pack(POS, flat[k * ROW_VALS : (k + 1) * ROW_VALS], K_OUT)
