"""Early assembly: captures copied into their result-pool regions while generation still runs, so that a
fetch only finishes what the last steps left (`VLLM_LENS_EARLY_ASSEMBLY`).

Without it, every captured row is copied from the step arenas into the pool at fetch time
(`assembly.assemble`): for an all-layer batch that is the whole result (GBs) after the last step. Here a
background thread in the worker copies the filed steps once their device->host copies have landed (an
event recorded on the side stream after the step's copy; on CPU the copy is synchronous), a few steps per
wake-up (`VLLM_LENS_EARLY_INTERVAL_MS`; at once when a fetch waits), into the final place of each request's rows:

- **Region**: a request gets one region of the result pool sized for its largest result, `layers x
  (prompt + max_tokens - 1) x d` — the size it announced at admission (`ResultPool.expect`), so the pool
  has already grown for it and memory stays bounded by the pool's limit. It is taken by the background
  thread when the request's first rows are copied (never in the step). A request whose announcement the
  pool refused (over `VLLM_LENS_SHM_POOL_GB`), or whose region cannot be taken, is assembled at fetch as
  before; so is every request of a fetch without shared memory.
- **Layout**: rows go to `base + layer * max_positions + position`. At fetch the frontend's number of
  positions is known; when it is smaller (a request stopped early) the layers are moved together in place
  and the region's tail is given back, so the result has exactly the layout `assemble` writes.
- **Arenas stay** until the fetch (as before): a request the background path could not finish is
  assembled from them at fetch, so early assembly never decides what a result contains.
- **Safety**: the thread never takes the store's lock. A request dropped / evicted while its rows are
  being copied is marked dead and its region freed by the thread between batches (never under a copy);
  a fetch first waits for the copies of every step filed so far (`flush`), then claims its requests'
  regions and waits for any batch in flight (`quiesce`), so nothing writes a region once it is handed out.
- Any failure of the thread turns early assembly off for the worker's life: every request then takes the
  fetch-time path (counted, logged), never a silent gap.
- **Direct** (`VLLM_LENS_DIRECT_POOL`, graph-path steps): the GPU writes the rows of an arena's *members*
  into their regions itself, one kernel per step on the copy stream (`direct_rows` gives the offsets and
  marks the rows written). Its first members are the requests whose region is, at its first step, in
  memory the GPU can write (segments registered with CUDA) — taken at that step (`take_now`, never
  waiting or growing the pool) or earlier by the thread; the thread skips those. The others join at the
  step after the thread has made their region, and the thread still copies all of their arena rows (the
  same bytes where both write). A step whose rows all belong to members gets no arena rows.
  A step filed from the Python path, or with direct writes off, turns its arena back to host copies for
  every request. A direct region is only freed after the copy stream's latest write (`fence`), and a
  fetch waits for that stream after claiming its regions, so no write lands in a region after it is freed
  or handed out.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import numpy as np
import torch

from vllm_worker.envs import get
from vllm_worker.protocol import errors
from vllm_worker.transport.assembly import note_missing, pool_result
from vllm_worker.transport.result_pool import ResultPool, host_array

logger = logging.getLogger("vllm_worker")

# A request's early state (`RequestResults.early`): one of these, or its `Dest`.
OFF = "off"  # not assembled early (decided at its first plan)
WANTED = "wanted"  # will get a region when its first rows are copied
PENDING = "pending"  # its region is being taken
DEAD = "dead"  # dropped / evicted while pending: the region goes back as soon as it is taken
CLAIMED = "claimed"  # handed to a fetch
FAILED = "failed"  # no region (pool full) or the thread failed: assembled at fetch

IDLE_EXIT_S = 2.0  # the thread ends after this long without work (started again by the next step)


def interval_s() -> float:
    """How often at most the thread takes the queued steps (unless a fetch waits): its Python (the copies'
    index building) shares the GIL with the step loop, the bottleneck of a host-bound decode; several steps
    per wake-up cost about what one does."""
    return get("VLLM_LENS_EARLY_INTERVAL_MS") / 1000


class Dest:
    """Where one request's captured rows go: row `base + out * n_max + position` of `rows` (its segment).
    `addr`: the segment's address when the GPU writes the rows itself (direct), else 0."""

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
    )

    def __init__(self, region: tuple, row: int, n_max: int, d: int, dtype: torch.dtype, mine: list, out_of_slot: dict):
        self.region = region
        self.base = region[1] // row
        self.n_max, self.d, self.dtype, self.row = n_max, d, dtype, row
        self.mine, self.out_of_slot = mine, out_of_slot
        self.rows: np.ndarray | None = None
        self.fill: np.ndarray | None = None
        self.dead = False
        self.addr = 0

    @property
    def nbytes(self) -> int:
        return len(self.mine) * self.n_max * self.row


class EarlyAssembler:
    """One per capture store. `filed` (the step thread, under the store's lock) queues a step; the
    background thread copies it; `flush` / `claim` / `quiesce` / `finish` serve a fetch."""

    def __init__(
        self,
        pool: Callable[[], ResultPool | None],
        timings: dict,
        executor: Callable[[int], Any],
        threads: Callable[[], int] = lambda: 1,
    ) -> None:
        self._pool = pool
        self._timings = timings
        self._executor = executor  # threads -> ThreadPoolExecutor (for large batches)
        self._cv = threading.Condition()
        self._queue: list[tuple[Any, int, int, Any]] = []  # (arena, chunk, steps filled, event or None)
        self._seq = 0  # steps queued ...
        self._done = 0  # ... and copied (or given up)
        self._busy = False
        self._hurry = 0  # fetches waiting in `flush`: the thread copies now, not at its next interval
        self._last = 0.0  # when the thread last took the queue
        self._thread: threading.Thread | None = None
        self._free: list[Dest] = []  # dead regions, freed by the thread between batches
        self.gen = 0  # bumped when a region is created, claimed or dies: arenas rebuild their maps
        self.broken = False
        self._rows: dict[tuple, np.ndarray] = {}  # (path, dtype, d) -> the segment as rows
        self._fills: dict[tuple, np.ndarray] = {}  # (path, row bytes) -> rows written (per segment row)
        self.threads = threads  # copy threads for one batch at most (the store's setting, read when asked)
        self._copiers: Any = None  # their executor, kept while the thread runs (not one per batch)
        # direct mode: the event after the copy stream's latest write into a region (set by the store,
        # under its lock, as it issues them); a direct region is freed only once it has passed
        self.fence: Any = None
        self.direct = False  # direct mode is on (set by the store as it files steps)
        self.dgen = 0  # bumped when a direct region dies or is claimed: arenas drop it from their direct maps
        self.dmade = 0  # bumped when the thread makes a region the GPU can write: arenas look for new members

    # ------------------------------------------------------------ step side (store lock held)

    def filed(self, arena: Any, event: Any) -> None:
        """A step was filed into `arena`'s last chunk (its copy done, or done when `event` is)."""
        with self._cv:
            self._queue.append((arena, len(arena.chunks) - 1, arena.chunks[-1][2], event))
            self._seq += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="lens-early-assembly", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def kill(self, st: Any) -> None:
        """The request is gone (dropped, evicted, or fetched without its region): its region is freed."""
        with self._cv:
            e = st.early
            if isinstance(e, Dest):
                e.dead = True
                self._free.append(e)
                self.gen += 1
                self.dgen += bool(e.addr)
                st.early = DEAD
                if self._thread is None:  # nothing is copying: free it now
                    self._free_dead()
                self._cv.notify_all()
            elif e == PENDING:
                st.early = DEAD
            elif e in (WANTED, FAILED):
                st.early = OFF

    def take_expected(self, st: Any) -> int:
        """The request's pool announcement, once (the region's taker and the store's release race)."""
        with self._cv:
            exp, st.expected = st.expected, 0
            return exp

    # ------------------------------------------------------------ fetch side

    def flush(self) -> float:
        """Wait until every step queued so far is copied (the tail: what the thread had not done yet)."""
        t = time.perf_counter()
        with self._cv:
            target = self._seq
            self._hurry += 1
            self._cv.notify_all()
            try:
                while self._done < target:
                    if self._thread is None or self.broken:  # never hang on a thread that stopped copying
                        break
                    self._cv.wait(0.5)
            finally:
                self._hurry -= 1
        return time.perf_counter() - t

    def claim(self, stores: list) -> dict[int, Dest]:
        """These requests' regions are the fetch's now (id(store) -> region): the thread will not start
        another copy into them; `quiesce` waits for one in flight."""
        got = {}
        with self._cv:
            for st in stores:
                e = st.early
                if isinstance(e, Dest) and self.broken and not _only_in_region(st):
                    # maybe half written, and the arenas hold every row: assembled at fetch
                    self._free.append(e)
                    st.early = FAILED
                elif isinstance(e, Dest):
                    got[id(st)] = e
                    st.early = CLAIMED
                    self.dgen += bool(e.addr)
                elif e in (WANTED, PENDING, FAILED):
                    st.early = FAILED  # counted when its fetch falls back
            if got:
                self.gen += 1
            if self.broken and not self._busy:  # the thread copies nothing more: free them now
                self._free_dead()
        return got

    def quiesce(self) -> None:
        with self._cv:
            while self._busy:
                self._cv.wait(0.5)

    def free_now(self, dest: Dest) -> None:
        """A claimed region the fetch does not use (after `quiesce`)."""
        pool = self._pool()
        if dest.addr:
            self._wait_fence()
        if pool is not None:
            pool.free([(dest.region[0], dest.region[1])])

    def finish(self, payload: dict, st: Any, n_pos: int, mine: list[int], dest: Dest) -> dict | None:
        """The claimed region as the request's result (the layout `assembly.assemble` writes), or None:
        not usable (the caller frees it and assembles the request at fetch)."""
        pool = self._pool()
        if pool is None or dest.mine != mine or not 0 < n_pos <= dest.n_max or dest.rows is None or dest.fill is None:
            return None
        segs = [s for s in st.segments if s.log.arena is not None and s.slot in dest.out_of_slot]
        if not any(s.log.arena.direct_steps or any(ch[2] for ch in s.log.arena.chunks) for s in segs):
            payload.setdefault("error", errors.failure("internal", "no positions were captured", "assembling results"))
            self.free_now(dest)
            return payload
        t = time.perf_counter()
        L, N, d = len(mine), dest.n_max, dest.d
        block = dest.rows[dest.base : dest.base + L * N]
        got = dest.fill[dest.base : dest.base + L * N].reshape(L, N)[:, :n_pos]
        if not got.all():  # rows the thread did not copy (it failed, or a member joined late): from the arenas
            _complete(block.reshape(L, N, d), got, segs, dest.out_of_slot, n_pos)
        if not got.all():
            block.reshape(L, N, d)[:, :n_pos][~got] = 0  # never another request's old rows
            note_missing(payload, mine, got)
        nbytes = L * n_pos * dest.row
        if n_pos < N:  # stopped before max_tokens: layers moved together (numpy copes with the overlap)
            for i in range(1, L):
                block[i * n_pos : (i + 1) * n_pos] = block[i * N : i * N + n_pos]
            pool.shrink(dest.region[0], dest.region[1], nbytes)
            self._timings["early_compact_s"] += time.perf_counter() - t
        return pool_result(payload, pool, dest.region, nbytes, dest.dtype, [L, n_pos, d], mine)

    # ------------------------------------------------------------ the thread

    def _loop(self) -> None:
        """The thread: `_serve`, and if our own code fails outside a batch, early assembly off (never a
        fetch waiting for a thread that is gone)."""
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001
            self._break(e)
            with self._cv:
                self._thread = None
                self._stop_copiers()
                self._busy = False
                self._done = self._seq
                self._cv.notify_all()

    def _serve(self) -> None:
        while True:
            with self._cv:
                timed_out = False
                if not self._queue and not self._free:
                    timed_out = not self._cv.wait(IDLE_EXIT_S)
                interval = interval_s()
                while self._queue and not self._hurry and not self._free:  # let a few steps gather
                    left = self._last + interval - time.perf_counter()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                self._free_dead()
                if not self._queue:
                    if timed_out:
                        self._thread = None
                        self._stop_copiers()
                        self._cv.notify_all()
                        return
                    continue
                items, self._queue = self._queue, []
                self._free_dead()
                self._busy = True
                self._last = time.perf_counter()
            try:
                if not self.broken:
                    self._batch(items)
            except Exception as e:  # noqa: BLE001 - every request falls back to the fetch-time path
                self._break(e)
            finally:
                with self._cv:
                    self._busy = False
                    self._done += len(items)
                    self._cv.notify_all()

    def _stop_copiers(self) -> None:
        """(The thread is ending.) Its copy threads go with it."""
        if self._copiers is not None:
            self._copiers.shutdown(wait=False)
            self._copiers = None

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

    def _break(self, e: BaseException) -> None:
        logger.error(
            "inspect-lens: early assembly failed (%s: %s); results are assembled at fetch from now on",
            type(e).__name__,
            e,
        )
        with self._cv:
            self.broken = True
            self.gen += 1

    def _batch(self, items: list) -> None:
        """Copy the queued steps. Few, large numpy calls: each releases the GIL while it copies and must take
        it back after, and every take-back while the step loop holds the GIL is a hand-off that loop pays
        for (measured on the H200: ~4,500 extra waits of the step thread per all-layer run when the copies
        went per column run). So a few index calls per block of an arena chunk (`_map`) and one copy per
        block and copy thread."""
        from vllm_worker.worker import faults  # (transport does not import the worker at load)

        faults.check("early")
        t0 = time.perf_counter()
        upto: dict[tuple[int, int], int] = {}
        arenas: dict[int, Any] = {}
        for arena, c, f, _ in items:
            arenas[id(arena)] = arena
            upto[(id(arena), c)] = max(upto.get((id(arena), c), 0), f)
        for arena in arenas.values():  # before waiting for the copies: the GPU can write them sooner (direct)
            self._regions(arena)
        last = items[-1][3]
        if last is not None:
            last.synchronize()  # the side stream runs in order: every queued step's copy has landed
        jobs: list[tuple] = []
        marks: list[tuple] = []
        nbytes = 0
        for aid, arena in arenas.items():
            cmap = self._map(arena)
            while len(arena.done) < len(arena.chunks):
                arena.done.append(0)
            for c in range(len(arena.chunks)):
                f = upto.get((aid, c))
                if f is None or f <= arena.done[c]:
                    continue
                s0, arena.done[c] = arena.done[c], f
                if cmap is not None:
                    nbytes += self._jobs(arena.chunks[c], s0, f, cmap, jobs, marks)
        t1 = time.perf_counter()
        most = self.threads()
        threads = max(1, min(most, nbytes // (128 << 20)))
        parts = _split(jobs, threads)
        if threads > 1 and len(parts) > 1:
            if self._copiers is None:
                self._copiers = self._executor(most)
            list(self._copiers.map(_run, parts))
        else:
            for part in parts:
                _run(part)
        for fill, idx in marks:
            fill[idx] = True
        t2 = time.perf_counter()
        self._timings["early_batches"] += 1
        self._timings["early_bytes"] += nbytes
        self._timings["early_index_s"] += t1 - t0
        self._timings["early_copy_s"] += t2 - t1

    def _regions(self, arena: Any) -> None:
        """Regions for the arena's requests that want one and have none yet (before any of their rows is
        copied: a request's rows are all in arenas, and each arena is mapped after this)."""
        with self._cv:
            todo = []
            for _, _, st, _ in arena.users:
                if st.early == WANTED:
                    st.early = PENDING
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
                    st.early = FAILED if st.early == PENDING else OFF
                    continue
                assert pool is not None
                dest = self._dest(st, region, pool, d, dtype, row)
                if self.direct:  # written by the GPU from its arena's next step on, if the GPU can
                    dest.addr = pool.address(region[0])
                if st.early != PENDING:  # dropped meanwhile
                    dest.dead = True
                    self._free.append(dest)
                    continue
                st.early = dest
                self.dmade += bool(dest.addr)

    def _dest(self, st: Any, region: tuple, pool: ResultPool, d: int, dtype: torch.dtype, row: int) -> Dest:
        """(cv held.) The request's `Dest` over a region just taken, its rows marked as not written."""
        mine = list(st.mine)
        out_of_slot = {st.layers.index(l): i for i, l in enumerate(mine)}
        dest = Dest(region, row, st.max_pos, d, dtype, mine, out_of_slot)
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

    # ------------------------------------------------------------ direct mode (step side, store lock held)

    def take_now(self, st: Any, pool: ResultPool, d: int, dtype: torch.dtype) -> bool:
        """At the request's first step: a region the GPU can write, from memory the pool has now (never
        waiting); False leaves the request to the thread's host copies."""
        row = d * _esize(dtype)
        with self._cv:
            if st.early != WANTED or self.broken:
                return False
            region = pool.alloc_now(len(st.mine) * st.max_pos * row, st.expected, align=row)
            if region is None:
                return False
            st.expected = 0
            dest = self._dest(st, region, pool, d, dtype, row)
            dest.addr = region[3]
            st.early = dest
            self._timings["direct_regions"] += 1
            return True

    def direct_rows(self, arena: Any, pos: np.ndarray, d: int, dtype: torch.dtype) -> tuple | None:
        """This step's rows (arena columns, at positions `pos`) as element offsets from an address the GPU
        writes them at: (origin, bytes from origin to the last target's end, offsets (-1: not written),
        whether every column is written so: the step needs no arena rows), or None.

        An arena's direct requests (`members`): at its first step, those whose region the GPU can write then
        (taken here, `take_now`, or earlier by the thread) — the thread never copies their rows (`skip`).
        A request whose region the thread makes later (it was still copying the prefill, or the pool had no
        registered room) joins at the next step: the GPU writes its rows from then on, and the thread still
        copies all of its arena rows (the same bytes where both write), so nothing before the join is lost.
        Once every request is a member, the arena's steps need no arena rows. The rows written here are
        marked here, so a step without arena rows needs nothing else."""
        if arena.direct is False or self.broken:
            return None
        first = arena.members is None
        if first or (not arena.direct_full and arena.seen != self.dmade):
            pool = self._pool()
            if pool is not None:
                seen: set[int] = set()
                for _, _, st, _ in arena.users:
                    if st.early == WANTED and id(st) not in seen:
                        seen.add(id(st))
                        self.take_now(st, pool, d, dtype)
            with self._cv:
                members = set(arena.members or ())
                full = True
                for _, _, st, slot in arena.users:
                    e = st.early
                    if isinstance(e, Dest) and e.addr and not e.dead and slot in e.out_of_slot:
                        members.add(id(e))
                    else:
                        full = False
                arena.seen = self.dmade
                if first:
                    arena.skip = frozenset(members)
                elif len(members) > len(arena.members or ()):
                    self._timings["direct_joins"] += len(members) - len(arena.members or ())
                    arena.direct_map = None
                arena.members = frozenset(members)
                arena.direct_full = full and bool(members)
                if members:
                    arena.direct = True
        if not arena.members:
            return None
        # rebuilt only when a member goes (regions of other requests do not matter here); `dgen` moves only
        # under the store's lock, which the caller holds: a valid map needs no lock (the thread may hold it)
        cached = arena.direct_map
        if cached is None or cached[0] != self.dgen:
            with self._cv:
                cached = arena.direct_map = (self.dgen, self._direct_map(arena, d, _esize(dtype)))
        got = cached[1]
        if got is None:  # every member is gone
            return None
        origin, span, off0, npos, row0, marks = got
        p = pos.astype(np.int64, copy=False)
        ok = (p >= 0) & (p < npos)
        offs = off0 + p * d
        offs[~ok] = -1
        for fill, cols in marks:  # per target segment: its columns' rows at this step's positions
            if cols is None:
                fill[(row0 + p)[ok]] = True
            else:
                pk = p[cols]
                fill[(row0[cols] + pk)[ok[cols]]] = True
        return origin, span, offs, arena.direct_full

    def _direct_map(self, arena: Any, d: int, esize: int) -> tuple | None:
        """(cv held.) Per column: the element offset of position 0's row from the lowest target segment, its
        positions' bound (0: not written), its row in its segment and which segment's marks it sets."""
        members = arena.members
        got = _user_columns(
            [(col, n, st.early, slot) for col, n, st, slot in arena.users],
            lambda e: id(e) in members,
            lambda e: e.fill,
        )
        if got is None:
            return None
        idx, n_arr, rows, bounds, codes, who, firsts = got
        origin = min(e.addr for e in who)
        end = max(e.addr + e.rows.shape[0] * e.row for e in who)
        start = np.array([(e.addr - origin) // esize for e in who], dtype=np.int64)
        off0 = np.zeros(arena.rows, dtype=np.int64)
        npos = np.zeros(arena.rows, dtype=np.int64)
        row0 = np.zeros(arena.rows, dtype=np.int64)
        tkey = np.full(arena.rows, -1, dtype=np.int64)
        off0[idx] = np.repeat(start, n_arr) + rows * d
        npos[idx] = bounds
        row0[idx] = rows
        tkey[idx] = codes
        # per target segment its columns (None: it has every written column)
        marks = [(e.fill, None if len(firsts) == 1 else np.flatnonzero(tkey == k)) for k, e in enumerate(firsts)]
        return origin, end - origin, off0, npos, row0, marks

    def _map(self, arena: Any) -> tuple | None:
        """Where the arena's columns go, cached on the arena until a region is made, claimed or dies: per
        column the destination row of position 0 and its positions' bound, and the columns as *blocks*
        (None: no column goes to a live region).

        A block is `m` runs of `w` adjacent columns, `gap` columns apart, all going to one destination
        segment: in a batch where every request captures the same layers, one segment's requests are the
        same run at every layer, so one block covers them all and the chunk's rows for it are one strided
        view (no gather, no temporary), copied with one numpy call per copy thread."""
        with self._cv:  # (held only to read the states: the step thread may be waiting for it)
            cached = arena.early
            if cached is not None and cached[0] == (self.gen, arena.direct is True and bool(arena.skip)):
                return cached[1]
            # the GPU writes (and the step thread marks) every row of a direct arena's first members: not
            # copied (members that joined later are copied too: their rows before the join are only here)
            skip = arena.skip if arena.direct is True else frozenset()
            states = [(col, n, st.early, slot) for col, n, st, slot in arena.users]
            gen = self.gen
        n_cols = arena.rows
        key = np.full(n_cols, -1, dtype=np.int64)
        base = np.zeros(n_cols, dtype=np.int64)
        npos = np.zeros(n_cols, dtype=np.int64)
        # (a region that dies meanwhile is freed only between batches)
        cols = _user_columns(states, lambda e: id(e) not in skip, lambda e: e.rows)
        targets: list[tuple[np.ndarray, np.ndarray]] = []
        if cols is not None:
            idx, _, rows, bounds, codes, _, firsts = cols
            base[idx], npos[idx], key[idx] = rows, bounds, codes
            targets = [(e.rows, e.fill) for e in firsts]
        got = None
        if targets:
            edges = np.flatnonzero(np.diff(key)) + 1
            starts = np.concatenate([[0], edges]).tolist()
            ends = np.concatenate([edges, [n_cols]]).tolist()
            blocks: list[list[int]] = []  # [target, first column, w, gap, m]
            latest: dict[int, list[int]] = {}
            for a, b in zip(starts, ends):
                k = int(key[a])
                if k < 0:
                    continue
                last = latest.get(k)  # this target's latest block (targets interleave within a layer)
                if last is not None and last[2] == b - a:
                    if last[4] == 1 and a > last[1]:
                        last[3], last[4] = a - last[1], 2
                        continue
                    if a == last[1] + last[4] * last[3]:
                        last[4] += 1
                        continue
                blocks.append([k, a, b - a, 0, 1])
                latest[k] = blocks[-1]
            got = (base, npos, targets, [tuple(b) for b in blocks])
        arena.early = ((gen, bool(skip)), got)
        return got

    @staticmethod
    def _jobs(chunk: list, s0: int, s1: int, cmap: tuple, jobs: list, marks: list) -> int:
        """Copy jobs for steps s0:s1 of one arena chunk, one per block; returns their bytes. A job is
        (segment rows, destination rows (steps, m, w), the source rows (steps, m, w, d): a strided view).
        `marks`: (segment's written-rows flags, rows) to set once the copies are done (a batch that fails
        halfway marks nothing: `finish` completes those rows from the arenas)."""
        base, npos, targets, blocks = cmap
        data, pos = chunk[0], chunk[1]
        a3 = host_array(data)[s0:s1]  # (steps, columns, d)
        p = pos.numpy()[s0:s1]
        row = data.shape[-1] * data.element_size()
        total = 0
        for k, c0, w, gap, m in blocks:
            rows, fill = targets[k]
            # the block's columns only (gaps dropped): the column axis becomes (m, w)
            pb = _block(p, 1, c0, w, gap, m)  # (steps, m, w)
            bb, nb = _block(base, 0, c0, w, gap, m), _block(npos, 0, c0, w, gap, m)  # (m, w)
            src = _block(a3, 1, c0, w, gap, m)  # (steps, m, w, d)
            dst = bb + pb  # (steps, m, w)
            ok = (pb >= 0) & (pb < nb)
            if ok.all():
                marks.append((fill, dst))
                jobs.append((rows, dst, src))
                total += dst.size * row
            else:  # positions outside the result (never expected): only the others
                marks.append((fill, dst[ok]))
                jobs.append((rows, dst[ok], src[ok]))
                total += int(ok.sum()) * row
        return total


def _user_columns(states: list, keep: Callable[[Dest], bool], by: Callable[[Dest], Any]) -> tuple | None:
    """One Python pass over an arena's users `(first column, columns, early state, slot)`, numpy for the
    columns (an all-layer batch has 32 users per request: a slice assignment per user took ~27 ms per arena
    on CPU). The users kept: those whose state is a live `Dest` holding their slot that `keep` accepts.
    Returns (their columns; per user its column count; per column its region's row of position 0, its
    positions' bound and its target's code — regions grouped by `by(dest)`; per user its Dest; one Dest per
    target, in code order), or None when no user is kept."""
    cols: list[int] = []
    ns: list[int] = []
    rows: list[int] = []
    codes: list[int] = []
    who: list[Dest] = []
    firsts: list[Dest] = []
    code: dict[int, int] = {}
    for col, n, e, slot in states:
        if not isinstance(e, Dest) or e.dead:
            continue
        i = e.out_of_slot.get(slot)
        if i is None or not keep(e):
            continue
        assert e.rows is not None and e.fill is not None  # set with the region
        k = code.get(id(by(e)))
        if k is None:
            k = code[id(by(e))] = len(firsts)
            firsts.append(e)
        cols.append(col)
        ns.append(n)
        rows.append(e.base + i * e.n_max)
        codes.append(k)
        who.append(e)
    if not cols:
        return None
    n_arr = np.array(ns, dtype=np.int64)
    idx = np.repeat(np.array(cols, dtype=np.int64) - np.cumsum(n_arr) + n_arr, n_arr) + np.arange(int(n_arr.sum()))

    def per_column(values: list[int]) -> np.ndarray:
        return np.repeat(np.array(values, dtype=np.int64), n_arr)

    bounds = per_column([e.n_max for e in who])
    return idx, n_arr, per_column(rows), bounds, per_column(codes), who, firsts


def _only_in_region(st: Any) -> bool:
    """Some of the request's rows were written only into its region (direct steps without arena rows)."""
    return any(s.log.arena is not None and s.log.arena.direct_steps for s in st.segments)


def _complete(block: np.ndarray, got: np.ndarray, segs: list, out_of_slot: dict, n_pos: int) -> None:
    """Rows of a region not written (`got[out, position]` False) copied from the request's arena rows (the
    fetch-time path's source), marked in `got`."""
    for s in segs:
        i = out_of_slot[s.slot]
        for pos, rows in s.log.arena.parts(s.log.col + s.offset, s.n):
            p = host_array(pos).ravel()
            src = host_array(rows).reshape(len(p), -1)
            keep = (p >= 0) & (p < n_pos)
            keep[keep] = ~got[i, p[keep]]
            if keep.any():
                block[i, p[keep]] = src[keep]
                got[i, p[keep]] = True


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _block(x: np.ndarray, axis: int, c0: int, w: int, gap: int, m: int) -> np.ndarray:
    """A view of `x` whose column `axis` is replaced by (m, w): runs of `w` columns from `c0`, `gap` apart."""
    st = x.strides[axis]
    return np.lib.stride_tricks.as_strided(
        x[(slice(None),) * axis + (slice(c0, None),)],
        x.shape[:axis] + (m, w) + x.shape[axis + 1 :],
        x.strides[:axis] + (gap * st, st) + x.strides[axis + 1 :],
    )


def _split(jobs: list, parts: int) -> list[tuple]:
    """The jobs cut into about `parts` pieces in all (a thread each), along their longest leading axis."""
    total = sum(j[1].size for j in jobs)
    if not total:
        return []
    per = max(1, -(-total // parts))
    out = []
    for rows, idx, src in jobs:
        n = max(1, -(-idx.size // per))  # pieces for this job
        axis = int(np.argmax(idx.shape))  # (steps, m, w) or, for the rare partial job, (rows,)
        length = idx.shape[axis]
        step = max(1, -(-length // n))
        for a in range(0, length, step):
            sl = (slice(None),) * axis + (slice(a, a + step),)
            out.append((rows, idx[sl], src[sl]))
    return out


def _run(part: tuple) -> None:
    """One piece: one numpy index copy from a view (no temporary), which releases the GIL for its length."""
    rows, idx, src = part
    rows[idx] = src
