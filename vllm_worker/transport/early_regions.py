"""Early assembly's per-request region state machine (`early` is the copier that fills the regions).

Each capturing request's `RequestResults.early` is a `State`; while it holds a region, `RequestResults.dest`
is its `EarlyRegion`. The moves (every one under the condition `Regions.cv`, checked by `move`):

    UNDECIDED -> OFF                     not assembled early (decided at its first plan, `decide`)
    UNDECIDED -> WANTED                  will get a region when its first rows are copied (or at its first
                                         direct step, `take_now`)
    WANTED    -> PENDING                 the thread is taking its region (`take`)
    PENDING   -> HELD | FAILED           region taken | no room: assembled at fetch
    WANTED    -> HELD                    a region the GPU can write, taken in the step (`take_now`)
    HELD      -> CLAIMED                 handed to a fetch (`claim`)
    HELD      -> DEAD                    dropped / evicted: its region is freed between batches (`kill`)
    PENDING   -> DEAD                    dropped while its region was being taken: freed once taken
    WANTED | FAILED -> OFF               dropped before it had a region
    WANTED | PENDING | FAILED | HELD -> FAILED   at its fetch without a usable region (`claim`)

Lock order, everywhere: the store's lock, then `cv`, then the result pool's lock — never the other way
(`lock_order`, asserted when its `CHECK` is set: the tests set it).
"""

from __future__ import annotations

import enum
import threading
from typing import Any, Callable

import numpy as np
import torch

from vllm_worker.transport import row_layout
from vllm_worker.transport.lock_order import LockOrder, Ordered
from vllm_worker.transport.result_pool import ResultPool


class State(enum.Enum):
    UNDECIDED = "undecided"
    OFF = "off"
    WANTED = "wanted"
    PENDING = "pending"
    HELD = "held"
    DEAD = "dead"
    CLAIMED = "claimed"
    FAILED = "failed"


S = State
MOVES: dict[State, frozenset[State]] = {
    S.UNDECIDED: frozenset({S.OFF, S.WANTED}),
    S.WANTED: frozenset({S.PENDING, S.HELD, S.OFF, S.FAILED}),
    S.PENDING: frozenset({S.HELD, S.FAILED, S.DEAD, S.OFF}),
    S.HELD: frozenset({S.CLAIMED, S.DEAD, S.FAILED}),
    S.FAILED: frozenset({S.OFF, S.FAILED}),
    S.DEAD: frozenset({S.OFF}),
    S.CLAIMED: frozenset(),
    S.OFF: frozenset(),
}


class BadMove(AssertionError):
    """A state change the machine does not have: a bug of ours, never a silent overwrite."""


def move(st: Any, to: State, dest: EarlyRegion | None = None) -> None:
    """(cv held.) `st.early` becomes `to`; `dest` is its region while HELD (and only then)."""
    if to not in MOVES[st.early]:
        raise BadMove(f"early assembly: {st.early.name} -> {to.name}")
    st.early = to
    st.dest = dest if to is S.HELD else None


class EarlyRegion:
    """Where one request's captured rows go: row `base + r0[out] + position * stride[out]` of `rows` (its
    segment; `row_layout`). `addr`: the segment's address when the GPU writes the rows itself (direct), else 0."""

    __slots__ = (
        "region",
        "base",
        "n_max",
        "d",
        "dtype",
        "row",
        "rows",
        "fill",
        "mine",
        "out_of_slot",
        "dead",
        "addr",
        "r0",
        "stride",
    )

    def __init__(self, region: tuple, row: int, n_max: int, d: int, dtype: torch.dtype, mine: list, out_of_slot: dict):
        self.region = region
        self.base = region[1] // row
        self.n_max, self.d, self.dtype, self.row = n_max, d, dtype, row
        self.mine, self.out_of_slot = mine, out_of_slot
        self.r0, self.stride = row_layout.layout(mine, n_max)
        self.rows: np.ndarray | None = None
        self.fill: np.ndarray | None = None
        self.dead = False
        self.addr = 0

    @property
    def nbytes(self) -> int:
        return len(self.mine) * self.n_max * self.row


class Regions:
    """The regions of one capture store's requests: taken, claimed by fetches, freed. `EarlyAssembler`
    (the copier) builds on it; `_copying` / `_busy` say whether its thread may write a region now."""

    def __init__(self, pool: Callable[[], ResultPool | None], timings: dict) -> None:
        self._pool = pool
        self._timings = timings
        self._cv = Ordered(threading.Condition(), LockOrder.CV)
        self._free: list[EarlyRegion] = []  # dead regions, freed between batches
        self._busy = False  # a batch of copies is in flight
        self.gen = 0  # bumped when a region is created, claimed or dies: arenas rebuild their maps
        self.broken = False
        self._rows: dict[tuple, np.ndarray] = {}  # (path, dtype, d) -> the segment as rows
        self._fills: dict[tuple, np.ndarray] = {}  # (path, row bytes) -> rows written (per segment row)
        # direct mode: the event after the copy stream's latest write into a region (set by the store,
        # under its lock, as it issues them); a direct region is freed only once it has passed
        self.fence: Any = None
        self.direct = False  # direct mode is on (set by the store as it files steps)
        self.dgen = 0  # bumped when a direct region dies or is claimed: arenas drop it from their direct maps
        self.dmade = 0  # bumped when the thread makes a region the GPU can write: arenas look for new members

    def _copying(self) -> bool:
        """The copier's thread is running (it frees dead regions between its batches)."""
        return False

    # ------------------------------------------------------------ step side (store lock held)

    def decide(self, st: Any, on: bool) -> bool:
        """At the request's first plan: early assembly or not; True when its rows are the copier's."""
        if st.early is S.UNDECIDED:
            with self._cv:
                move(st, S.WANTED if on and st.expected and st.max_pos and st.mine else S.OFF)
        return st.early is not S.OFF

    def kill(self, st: Any) -> None:
        """The request is gone (dropped, evicted, or fetched without its region): its region is freed."""
        with self._cv:
            e = st.early
            if e is S.HELD:
                dest = st.dest
                dest.dead = True
                self._free.append(dest)
                self.gen += 1
                self.dgen += bool(dest.addr)
                move(st, S.DEAD)
                if not self._copying():  # nothing is copying: free it now
                    self._free_dead()
                self._cv.notify_all()
            elif e is S.PENDING:
                move(st, S.DEAD)
            elif e in (S.WANTED, S.FAILED):
                move(st, S.OFF)

    def take_expected(self, st: Any) -> int:
        """The request's pool announcement, once (the region's taker and the store's release race)."""
        with self._cv:
            exp, st.expected = st.expected, 0
            return exp

    def take_now(self, st: Any, pool: ResultPool, d: int, dtype: torch.dtype) -> bool:
        """At the request's first step: a region the GPU can write, from memory the pool has now (never
        waiting); False leaves the request to the thread's host copies."""
        row = d * esize(dtype)
        with self._cv:
            if st.early is not S.WANTED or self.broken:
                return False
            region = pool.alloc_now(len(st.mine) * st.max_pos * row, st.expected, align=row)
            if region is None:
                return False
            st.expected = 0
            dest = self._dest(st, region, pool, d, dtype, row)
            dest.addr = region[3]
            move(st, S.HELD, dest)
            self._timings["direct_regions"] += 1
            return True

    # ------------------------------------------------------------ fetch side

    def claim(self, stores: list) -> dict[int, EarlyRegion]:
        """These requests' regions are the fetch's now (id(store) -> region): the thread will not start
        another copy into them; `quiesce` waits for one in flight."""
        got = {}
        with self._cv:
            for st in stores:
                e = st.early
                if e is S.HELD and self.broken and not only_in_region(st):
                    # maybe half written, and the arenas hold every row: assembled at fetch
                    self._free.append(st.dest)
                    move(st, S.FAILED)
                elif e is S.HELD:
                    got[id(st)] = st.dest
                    self.dgen += bool(st.dest.addr)
                    move(st, S.CLAIMED)
                elif e in (S.WANTED, S.PENDING, S.FAILED):
                    move(st, S.FAILED)  # counted when its fetch falls back
            if got:
                self.gen += 1
            if self.broken and not self._busy:  # the thread copies nothing more: free them now
                self._free_dead()
        return got

    def free_now(self, dest: EarlyRegion) -> None:
        """A claimed region the fetch does not use (after `quiesce`)."""
        pool = self._pool()
        if dest.addr:
            self._wait_fence()
        if pool is not None:
            pool.free([(dest.region[0], dest.region[1])])

    # ------------------------------------------------------------ the thread's side

    def _wait_fence(self) -> None:
        ev = self.fence
        if ev is not None:
            ev.synchronize()

    def _free_dead(self) -> None:
        """(cv held, no batch in flight.)"""
        if self._free:
            if any(e.addr for e in self._free):
                self._wait_fence()
            pool = self._pool()
            if pool is not None:
                pool.free([(e.region[0], e.region[1]) for e in self._free])
            self._timings["early_freed"] += len(self._free)
            self._free = []

    def _regions(self, arena: Any) -> None:
        """Regions for the arena's requests that want one and have none yet (before any of their rows is
        copied: a request's rows are all in arenas, and each arena is mapped after this)."""
        with self._cv:
            todo = []
            for _, _, st, _ in arena.users:
                if st.early is S.WANTED:
                    move(st, S.PENDING)
                    exp, st.expected = st.expected, 0
                    todo.append((st, exp))
        if not todo:
            return
        pool = self._pool()
        data = arena.chunks[0][0]
        d, dtype = data.shape[-1], data.dtype
        row = d * data.element_size()
        for st, exp in todo:
            region = None
            if pool is not None:
                region = pool.alloc(len(st.mine) * st.max_pos * row, exp, align=row)
            with self._cv:
                if region is None:
                    move(st, S.FAILED if st.early is S.PENDING else S.OFF)
                    continue
                assert pool is not None
                dest = self._dest(st, region, pool, d, dtype, row)
                if self.direct:  # written by the GPU from its arena's next step on, if the GPU can
                    dest.addr = pool.address(region[0])
                if st.early is not S.PENDING:  # dropped meanwhile
                    dest.dead = True
                    self._free.append(dest)
                    move(st, S.OFF)
                    continue
                move(st, S.HELD, dest)
                self.dmade += bool(dest.addr)

    def _dest(self, st: Any, region: tuple, pool: ResultPool, d: int, dtype: torch.dtype, row: int) -> EarlyRegion:
        """(cv held.) The request's `EarlyRegion` over a region just taken, its rows marked as not written."""
        mine = list(st.mine)
        out_of_slot = {st.layers.index(l): i for i, l in enumerate(mine)}
        dest = EarlyRegion(region, row, st.max_pos, d, dtype, mine, out_of_slot)
        key = (region[0], dtype, d)
        if key not in self._rows:
            live = pool.segment_paths()
            for k in [k for k in self._rows if k[0] not in live]:
                del self._rows[k]
            for k in [k for k in self._fills if k[0] not in live]:
                del self._fills[k]
            self._rows[key] = pool.rows(region[0], dtype, d)
        dest.rows = self._rows[key]
        fill = self._fills.get((region[0], row))
        if fill is None:
            fill = self._fills[(region[0], row)] = np.zeros(dest.rows.shape[0], dtype=bool)
        fill[dest.base : dest.base + len(mine) * st.max_pos] = False
        dest.fill = fill
        self.gen += 1
        return dest


def held(st: Any) -> EarlyRegion | None:
    """The request's live region, if it holds one."""
    return st.dest if st.early is S.HELD and not st.dest.dead else None


def only_in_region(st: Any) -> bool:
    """Some of the request's rows were written only into its region (direct steps without arena rows)."""
    return any(s.log.arena is not None and s.log.arena.direct_steps for s in st.segments)


def esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
