"""The first plan of a batch takes shortcuts where requests share content; each must give what the plain
computation gives, array for array: entry parts shared by requests holding one entries object
(`plan._entry_parts` with the graph taps' memo), the live columns marked in a mask (`GraphPlan.live_cols`),
the action rows of all items in one numpy pass (`actions.staged_rows_of` against each request's own)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np

from vllm_worker.worker import plan
from vllm_worker.worker.actions import staged_rows_of
from vllm_worker.worker.plan import PARTS_KEPT, RequestState, graph_plan


def _entries(rng: random.Random, sites: list[int]) -> dict:
    """Entries as admission makes them: fixed, by named positions, or by phase, per site."""
    out = {}
    for s in sites:
        kind = rng.randrange(3)
        if kind == 0:
            out[s] = (rng.randrange(50), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32), -1, -1)
        elif kind == 1:
            pos = np.array(sorted(rng.sample(range(40), 3)), dtype=np.int64)
            out[s] = (rng.randrange(50), pos, np.array([1, 2, 3], dtype=np.int32), -1, -1)
        else:
            out[s] = (rng.randrange(50), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32), 7, 30)
    return out


def _state(entries: dict) -> RequestState:
    return RequestState([], {}, 0, [], [], None, entries=entries)


def _same(a: plan.GraphPlan, b: plan.GraphPlan) -> None:
    for name in ("cap_rows", "cap_cols", "st_rows", "st_cols", "st_ents"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert len(a.st_pos) == len(b.st_pos)
    for p, q in zip(a.st_pos, b.st_pos):
        assert p[:3] == q[:3] and p[5:] == q[5:]
        assert np.array_equal(p[3], q[3]) and np.array_equal(p[4], q[4])
    assert len(a.ph) == len(b.ph) and all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a.ph, b.ph))
    assert a.live_cols == b.live_cols


def _old_live_cols(gp: plan.GraphPlan) -> frozenset:
    return (
        frozenset(gp.cap_cols.tolist())
        | frozenset(gp.st_cols.tolist())
        | frozenset(c for _, _, c, *_ in gp.st_pos)
        | (frozenset(gp.ph[1].tolist()) if gp.ph else frozenset())
    )


def test_shared_parts_equal_own_parts() -> None:
    """Requests sharing an entries object (and some with their own) plan as if each made its own parts;
    a shared part is read-only and the memo stays bounded."""
    rng = random.Random(3)
    sites = [16 * l + 1 for l in range(12)]
    col = {s: i for i, s in enumerate(sites)}
    shared = [_entries(rng, rng.sample(sites, rng.randrange(1, 12))) for _ in range(3)]
    memo: dict = {}
    for trial in range(6):
        held, own, active, row = [], [], [], 0
        for _ in range(40):
            e = rng.choice(shared) if rng.random() < 0.7 else _entries(rng, rng.sample(sites, 4))
            n = rng.choice([1, 1, 5, 30])
            held.append((_state(e), row, row + n))
            own.append((_state({k: v for k, v in e.items()}), row, row + n))  # (an equal dict: its own parts)
            row += n
            active = held
        gp = graph_plan(active, {}, row, col, memo)
        ref = graph_plan(own, {}, row, col)
        _same(gp, ref)
        assert gp.live_cols == _old_live_cols(gp)
        assert len(memo) <= PARTS_KEPT
        holders, parts = 0, set()
        for r, _, _ in held:
            assert not r.graph_parts[2][0].flags.writeable and not r.graph_parts[2][1].flags.writeable
            if any(r.entries is e for e in shared):
                holders += 1
                parts.add(id(r.graph_parts[2]))
        assert len(parts) < holders  # (shared: made once for several requests)
        again = graph_plan(held, {}, row, col, memo)  # (each request's own cache now)
        _same(again, ref)


def test_memo_is_per_column_map() -> None:
    """An entries object met again with another column map (another stage's taps) is worked out anew."""
    e = {1: (4, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32), -1, -1)}
    memo: dict = {}
    a = graph_plan([(_state(e), 0, 2)], {}, 2, {1: 0}, memo)
    b = graph_plan([(_state(e), 0, 2)], {}, 2, {1: 5}, memo)
    assert a.st_cols.tolist() == [0, 0] and b.st_cols.tolist() == [5, 5]


def test_live_cols_mask_equals_sets() -> None:
    rng = random.Random(5)
    for _ in range(50):
        n = rng.randrange(0, 30)
        gp = plan.GraphPlan(
            n,
            np.array([rng.randrange(40) for _ in range(rng.randrange(0, 9))], dtype=np.int64),
            np.array([rng.randrange(40) for _ in range(rng.randrange(0, 9))], dtype=np.int64),
            np.zeros(0, dtype=np.int64),
            np.array([rng.randrange(40) for _ in range(rng.randrange(0, 9))], dtype=np.int64),
            np.zeros(0, dtype=np.int32),
            [(0, 1, rng.randrange(40), np.zeros(0), np.zeros(0), -1, -1, -1) for _ in range(rng.randrange(0, 3))],
            ph=() if rng.random() < 0.5 else (np.zeros(2), np.array([rng.randrange(40), 3], dtype=np.int64)),
        )
        assert gp.live_cols == _old_live_cols(gp)


def _staged_rows(r: SimpleNamespace, s: int, e: int) -> np.ndarray:
    """One request's action rows: its last `max(rows)` of [s, e), or all of them when an action watches
    every row."""
    if any(u.every_row for u in r.acts):
        return np.arange(s, e, dtype=np.int64)
    return np.arange(max(s, e - max((u.rows for u in r.acts), default=1)), e, dtype=np.int64)


def test_staged_rows_of_equals_each() -> None:
    """All items' action rows at once: every request's own (`_staged_rows`), in order, the same dtype; a request's
    count is remade when its actions list is replaced."""
    rng = random.Random(7)
    for _ in range(200):
        items, row = [], 0
        for _ in range(rng.randrange(1, 12)):
            acts = [
                SimpleNamespace(every_row=rng.random() < 0.2, rows=rng.randrange(1, 4))
                for _ in range(rng.randrange(1, 3))
            ]
            n = rng.choice([1, 2, 3, 7, 30])
            items.append((SimpleNamespace(acts=acts, staged=None), row, row + n))
            row += n + rng.randrange(0, 3)
        want = np.concatenate([_staged_rows(r, s, e) for r, s, e in items])
        for _ in range(2):  # (the second time from each request's remembered count)
            got = staged_rows_of(items)
            assert got.dtype == want.dtype and np.array_equal(got, want)
        r = items[0][0]
        r.acts = [SimpleNamespace(every_row=True, rows=1)]
        s, e = items[0][1], items[0][2]
        assert np.array_equal(staged_rows_of([(r, s, e)]), np.arange(s, e))
    assert staged_rows_of([]).dtype == np.int64 and len(staged_rows_of([])) == 0
