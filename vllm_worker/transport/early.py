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
from vllm_worker.transport import early_maps, row_layout
from vllm_worker.transport.assembly import note_missing, pool_result
from vllm_worker.transport.early_maps import run, split
from vllm_worker.transport.early_regions import EarlyRegion, Regions, State, esize, held
from vllm_worker.transport.result_pool import ResultPool

logger = logging.getLogger("vllm_worker")

# The region states (`early_regions.State`), as the store names them
OFF, WANTED, FAILED = State.OFF, State.WANTED, State.FAILED

IDLE_EXIT_S = 2.0  # the thread ends after this long without work (started again by the next step)


def interval_s() -> float:
    """How often at most the thread takes the queued steps (unless a fetch waits): its Python (the copies'
    index building) shares the GIL with the step loop, the bottleneck of a host-bound decode; several steps
    per wake-up cost about what one does."""
    return get("VLLM_LENS_EARLY_INTERVAL_MS") / 1000


class EarlyAssembler(Regions):
    """One per capture store. `filed` (the step thread, under the store's lock) queues a step; the
    background thread copies it; `flush` / `claim` / `quiesce` / `finish` serve a fetch. The regions'
    state machine is `Regions`'."""

    def __init__(
        self,
        pool: Callable[[], ResultPool | None],
        timings: dict,
        executor: Callable[[int], Any],
        threads: Callable[[], int] = lambda: 1,
        fault: Callable[[str], None] = lambda stage: None,
    ) -> None:
        super().__init__(pool, timings)
        self._fault = fault  # fault injection for tests (`worker.faults.check`: transport never imports the worker)
        self._executor = executor  # threads -> ThreadPoolExecutor (for large batches)
        self._queue: list[tuple[Any, int, int, Any]] = []  # (arena, chunk, steps filled, event or None)
        self._seq = 0  # steps queued ...
        self._done = 0  # ... and copied (or given up)
        self._hurry = 0  # fetches waiting in `flush`: the thread copies now, not at its next interval
        self._last = 0.0  # when the thread last took the queue
        self._thread: threading.Thread | None = None
        self.threads = threads  # copy threads for one batch at most (the store's setting, read when asked)
        self._copiers: Any = None  # their executor, kept while the thread runs (not one per batch)

    def _copying(self) -> bool:
        return self._thread is not None

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

    def quiesce(self) -> None:
        with self._cv:
            while self._busy:
                self._cv.wait(0.5)

    def finish(self, payload: dict, st: Any, n_pos: int, mine: list[int], dest: EarlyRegion) -> dict | None:
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
        at = row_layout.rows(mine, N, n_pos)  # (output, position) -> row of `block`
        got = dest.fill[dest.base + at]
        if not got.all():  # rows the thread did not copy (it failed, or a member joined late): from the arenas
            early_maps.complete(block, at, got, segs, dest.out_of_slot, n_pos)
        if not got.all():
            block[at[~got]] = 0  # never another request's old rows
            note_missing(payload, mine, got)
        nbytes = L * n_pos * dest.row
        if n_pos < N:  # stopped before max_tokens: outputs moved together (numpy copes with the overlap)
            for src, dst, n in row_layout.compaction(mine, N, n_pos):
                if src != dst:
                    block[dst : dst + n] = block[src : src + n]
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
        for (docs/decisions.md). So a few index calls per block of an arena chunk (`_map`) and one copy per
        block and copy thread."""
        self._fault("early")
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
        parts = split(jobs, threads)
        if threads > 1 and len(parts) > 1:
            if self._copiers is None:
                self._copiers = self._executor(most)
            list(self._copiers.map(run, parts))
        else:
            for part in parts:
                run(part)
        for fill, idx in marks:
            fill[idx] = True
        t2 = time.perf_counter()
        self._timings["early_batches"] += 1
        self._timings["early_bytes"] += nbytes
        self._timings["early_index_s"] += t1 - t0
        self._timings["early_copy_s"] += t2 - t1

    # ------------------------------------------------------------ direct mode (step side, store lock held)

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
                    if st.early is WANTED and id(st) not in seen:
                        seen.add(id(st))
                        self.take_now(st, pool, d, dtype)
            with self._cv:
                members = set(arena.members or ())
                full = True
                for _, _, st, slot in arena.users:
                    e = held(st)
                    if e is not None and e.addr and slot in e.out_of_slot:
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
                cached = arena.direct_map = (self.dgen, self._direct_map(arena, d, esize(dtype)))
        got = cached[1]
        if got is None:  # every member is gone
            return None
        offs, origin, span = early_maps.mark_direct(got, pos, d)
        return origin, span, offs, arena.direct_full

    def _direct_map(self, arena: Any, d: int, size: int) -> tuple | None:
        """(cv held.) `early_maps.direct_map` of the arena's members."""
        members = arena.members
        cols = early_maps.user_columns(
            [(col, n, held(st), slot) for col, n, st, slot in arena.users],
            lambda e: id(e) in members,
            lambda e: e.fill,
        )
        return early_maps.direct_map(arena.rows, cols, d, size)

    def _map(self, arena: Any) -> tuple | None:
        """Where the arena's columns go (`early_maps.block_map`), cached on the arena until a region is made,
        claimed or dies."""
        with self._cv:  # (held only to read the states: the step thread may be waiting for it)
            cached = arena.early
            if cached is not None and cached[0] == (self.gen, arena.direct is True and bool(arena.skip)):
                return cached[1]
            # the GPU writes (and the step thread marks) every row of a direct arena's first members: not
            # copied (members that joined later are copied too: their rows before the join are only here)
            skip = arena.skip if arena.direct is True else frozenset()
            states = [(col, n, held(st), slot) for col, n, st, slot in arena.users]
            gen = self.gen
        # (a region that dies meanwhile is freed only between batches)
        cols = early_maps.user_columns(states, lambda e: id(e) not in skip, lambda e: e.rows)
        got = early_maps.block_map(arena.rows, cols)
        arena.early = ((gen, bool(skip)), got)
        return got

    @staticmethod
    def _jobs(chunk: list, s0: int, s1: int, cmap: tuple, jobs: list, marks: list) -> int:
        return early_maps.jobs(chunk, s0, s1, cmap, jobs, marks)
