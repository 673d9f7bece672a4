"""Early assembly's region state machine (`transport.early_regions`), its lock order (`transport.lock_order`)
and its pure column maps (`transport.early_maps`), on their own: a real result pool, no engine."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from vllm_worker.transport import early_maps, lock_order
from vllm_worker.transport.early_regions import BadMove, EarlyRegion, Regions, State, held, move
from vllm_worker.transport.result_pool import ResultPool

D = 8


@dataclass
class St:
    """The fields of `RequestResults` the state machine reads."""

    layers: list = field(default_factory=lambda: [0, 1])
    mine: list = field(default_factory=lambda: [0, 1])
    max_pos: int = 4
    expected: int = 0
    segments: list = field(default_factory=list)
    early: State = State.UNDECIDED
    dest: EarlyRegion | None = None


class Arena:
    def __init__(self, users: list) -> None:
        self.users = users
        self.chunks = [[torch.zeros(1, len(users), D), None, 0]]


def _timings() -> dict:
    return {"early_freed": 0, "direct_regions": 0}


@pytest.fixture
def pool():
    p = ResultPool()
    yield p
    p.close()


def test_a_request_moves_through_its_states_and_its_region_goes_back(pool):
    regions = Regions(lambda: pool, _timings())
    st = St(expected=pool.expect(2 * 4 * D * 4))
    assert regions.decide(st, on=True) and st.early is State.WANTED
    regions._regions(Arena([(0, 1, st, 0), (1, 1, st, 1)]))
    assert st.early is State.HELD and held(st) is st.dest and pool.status()["regions_in_use"] == 1
    got = regions.claim([st])
    assert st.early is State.CLAIMED and st.dest is None and list(got.values())[0].nbytes == 2 * 4 * D * 4
    regions.free_now(got[id(st)])
    assert pool.status()["regions_in_use"] == 0
    regions.kill(st)  # a claimed request's release: nothing more to do
    assert st.early is State.CLAIMED


def test_a_request_killed_while_holding_its_region_frees_it_and_never_moves_back(pool):
    regions = Regions(lambda: pool, _timings())
    st = St(expected=pool.expect(2 * 4 * D * 4))
    regions.decide(st, on=True)
    regions._regions(Arena([(0, 1, st, 0)]))
    regions.kill(st)
    assert st.early is State.DEAD and st.dest is None and pool.status()["regions_in_use"] == 0
    assert regions._timings["early_freed"] == 1
    with pytest.raises(BadMove):  # a dead request never gets a region back
        move(st, State.HELD)


def test_off_requests_and_requests_without_room():
    regions = Regions(lambda: None, _timings())
    off = St()
    assert not regions.decide(off, on=True) and off.early is State.OFF  # nothing announced
    st = St(expected=4096)
    regions.decide(st, on=True)
    regions._regions(Arena([(0, 1, st, 0)]))  # no pool: no region
    assert st.early is State.FAILED and regions.claim([st]) == {} and st.early is State.FAILED
    regions.kill(st)
    assert st.early is State.OFF


def test_a_broken_copier_hands_out_only_regions_holding_rows_nowhere_else(pool):
    regions = Regions(lambda: pool, _timings())
    sts = [St(expected=pool.expect(2 * 4 * D * 4)) for _ in range(2)]
    for st in sts:
        regions.decide(st, on=True)
    regions._regions(Arena([(0, 1, sts[0], 0), (1, 1, sts[1], 0)]))
    direct_only = type("A", (), {"direct_steps": 1})()
    sts[1].segments = [type("S", (), {"log": type("L", (), {"arena": direct_only})()})()]
    regions.broken = True
    got = regions.claim(sts)
    assert sts[0].early is State.FAILED and id(sts[0]) not in got  # the arenas hold all of its rows
    assert sts[1].early is State.CLAIMED and id(sts[1]) in got  # some rows only in its region
    assert pool.status()["regions_in_use"] == 1


def test_the_lock_order_is_asserted(monkeypatch):
    monkeypatch.setattr(lock_order, "CHECK", True)
    store = lock_order.Ordered(threading.Lock(), lock_order.LockOrder.STORE)
    cv = lock_order.Ordered(threading.Condition(), lock_order.LockOrder.CV)
    pool = lock_order.Ordered(threading.Lock(), lock_order.LockOrder.POOL)
    with store, cv, pool:  # store -> cv -> pool
        pass
    with cv:
        with pytest.raises(AssertionError, match="lock order"):
            with store:
                pass
    with store:  # the failed attempt left nothing behind
        pass


def _dest(seg: np.ndarray, fill: np.ndarray, first_row: int, n_max: int, addr: int = 0) -> EarlyRegion:
    dest = EarlyRegion(("seg", first_row * D * 2, 0), D * 2, n_max, D, torch.bfloat16, [0, 1], {0: 0, 1: 1})
    dest.rows, dest.fill, dest.addr = seg, fill, addr
    return dest


def test_column_maps_for_host_copies_and_direct_writes():
    """Two requests capturing two layers (columns: layer-major, one row per request per step): one block
    per request (two runs of one column, two columns apart) and, for direct writes, each column's element
    offset and the rows it marks."""
    (sa, fa), (sb, fb) = [(np.zeros((64, D), np.int16), np.zeros(64, bool)) for _ in range(2)]
    a, b = _dest(sa, fa, 0, 4), _dest(sb, fb, 8, 4)  # two segments: two targets
    users = [(0, 1, a, 0), (1, 1, b, 0), (2, 1, a, 1), (3, 1, b, 1)]  # (column, n, dest, slot)
    cols = early_maps.user_columns(users, lambda e: True, lambda e: e.rows)
    base, npos, targets, blocks, stride = early_maps.block_map(4, cols)
    assert stride.tolist() == [1] * 4  # no mlp_post pieces: positions are consecutive rows
    assert base.tolist() == [0, 8, 4, 12] and npos.tolist() == [4] * 4 and len(targets) == 2
    assert sorted(blocks) == [(0, 0, 1, 2, 2), (1, 1, 1, 2, 2)]  # [target, first column, w, gap, m]
    assert early_maps.block_map(4, None) is None
    # direct: element offsets from the lowest segment address, rows marked at this step's positions
    a.addr, b.addr = 1 << 20, (1 << 20) + 64 * D * 2
    got = early_maps.direct_map(4, early_maps.user_columns(users, lambda e: True, lambda e: e.fill), D, 2)
    offs, origin, span = early_maps.mark_direct(got, np.array([2, 2, 2, 9]), D)
    assert origin == 1 << 20 and span == 2 * 64 * D * 2
    assert offs.tolist() == [2 * D, 64 * D + (8 + 2) * D, (4 + 2) * D, -1]
    assert np.flatnonzero(fa).tolist() == [2, 6] and np.flatnonzero(fb).tolist() == [10]  # position 9: past n_max


def test_complete_fills_only_the_rows_not_written():
    region = np.zeros((2, 4, D), np.float32)
    at = np.arange(8).reshape(2, 4)  # (output, position) -> row of the region
    got = np.zeros((2, 4), bool)
    got[0, :2] = True
    region[0, :2] = 7
    arena_rows = torch.arange(4 * D, dtype=torch.float32).reshape(1, 4, D)  # one chunk: (steps, n, d)
    pos = torch.arange(4).reshape(1, 4)

    class Arena:
        def parts(self, col, n):
            return [(pos, arena_rows)]

    seg = type("Seg", (), {"slot": 0, "offset": 0, "n": 4, "log": type("L", (), {"arena": Arena(), "col": 0})()})()
    early_maps.complete(region.reshape(8, D), at, got, [seg], {0: 0}, 4)
    assert (region[0, :2] == 7).all() and np.array_equal(region[0, 2:], arena_rows[0, 2:].numpy())
    assert got[0].all() and not got[1].any()
