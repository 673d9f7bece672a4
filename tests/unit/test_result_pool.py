"""The shared-memory result pool on its own (no engine): exact bytes through the frontend's zero-copy
view, release only when the last tensor is gone, reuse, growth ahead, trimming, and a full tmpfs."""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch

from vllm_worker.transport import early_maps, result_pool, result_views, shm
from vllm_worker.transport.early_regions import State
from vllm_worker.transport.result_pool import ResultPool, np_dtype


def _write(pool: ResultPool, t: torch.Tensor) -> dict:
    nbytes = t.numel() * t.element_size()
    path, off, size, arr = pool.alloc(nbytes)
    arr.view(np_dtype(t.dtype)).reshape(t.shape)[...] = (t.view(torch.int16) if t.element_size() == 2 else t).numpy()
    return {"path": path, "offset": off, "size": size, "nbytes": nbytes, "shape": list(t.shape)}


def test_a_region_round_trips_exactly_and_returns_only_when_its_last_tensor_is_gone():
    pool = ResultPool()
    try:
        src = torch.randn(3, 5, 64).to(torch.bfloat16)
        desc = _write(pool, src)
        got = result_views.view(desc, torch.bfloat16)
        assert torch.equal(got, src) and got.untyped_storage().nbytes() == desc["nbytes"]
        view_of_view = got[1:, 2]
        del got
        gc.collect()
        assert result_views.take_released({pool.id}) == []  # a view of it is still alive
        other = _write(pool, torch.ones(4, 64))
        assert other["path"] != desc["path"] or other["offset"] >= desc["offset"] + desc["nbytes"]
        assert torch.equal(view_of_view, src[1:, 2])  # not overwritten
        del view_of_view
        gc.collect()
        released = result_views.take_released({pool.id})
        assert released == [(desc["path"], desc["offset"])]
        assert result_views.take_released({"another-pool"}) == []
        free_before = pool.free_bytes
        assert pool.free(released + [("/dev/shm/elsewhere", 0)]) == 1  # other pools' entries are ignored
        assert pool.free_bytes > free_before
        again = _write(pool, torch.zeros(3, 5, 64).to(torch.bfloat16))
        assert (again["path"], again["offset"]) == (desc["path"], desc["offset"])  # reused, no new segment
        assert pool.status()["segments_made"] == 1 and pool.status()["sync_grows"] == 1
        result_views.discard(again)
        result_views.discard(other)
        pool.free(result_views.take_released({pool.id}))
        seg = pool._segments[desc["path"]]
        assert seg.free == [[0, seg.size]] and not seg.used  # coalesced back into one free range
    finally:
        pool.close()
    assert not os.path.exists(desc["path"])


def test_growth_ahead_covers_announced_results_and_idle_memory_is_given_back(monkeypatch):
    pool = ResultPool()
    try:
        assert pool.expect(100 << 20) == 100 << 20
        deadline = time.time() + 30
        while pool.free_bytes < (100 << 20) and time.time() < deadline:
            time.sleep(0.01)
        assert pool.free_bytes >= 100 << 20
        path, off, size, arr = pool.alloc(90 << 20, expected=100 << 20)
        assert pool.expected == 0 and pool.stats["sync_grows"] == 0
        pool.free([(path, off)])
        pool.trim(keep=0)
        assert pool.size == 0 and not os.path.exists(path) and pool.status()["segments_dropped"] == 1
        # more announced than VLLM_LENS_SHM_POOL_GB: not grown ahead (a fetch still gets memory)
        monkeypatch.setenv("VLLM_LENS_SHM_POOL_GB", "0.01")
        assert pool.expect(100 << 20) == 0
    finally:
        pool.close()


def test_a_full_tmpfs_is_an_ordinary_fallback_and_foreign_files_are_refused(monkeypatch, tmp_path):
    pool = ResultPool()

    def full(fd, off, n):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    try:
        assert pool.alloc(1 << 20) is None  # the caller sends bytes over RPC instead
        assert not [f for f in os.listdir(shm.shm_dir()) if pool.id in f]
    finally:
        pool.close()
    with pytest.raises(ValueError, match="not a result-pool file"):
        result_views.view(
            {"path": str(tmp_path / "x-pool1-1"), "offset": 0, "size": 4096, "nbytes": 4, "shape": [1]}, torch.float32
        )
    monkeypatch.setenv("VLLM_LENS_SHM", "0")
    assert shm.host_id() is None


def test_batch_assembly_in_threads_puts_every_row_in_its_place(monkeypatch):
    """`assembly.assemble` on synthetic step arenas, with several threads and small copy jobs (the path a
    large GPU fetch takes, which no CPU engine test reaches): every (request, layer, position) row lands in
    its request's region, for requests fetched out of column order, a subset of the arena's requests, and a
    request whose last step ran past its result (that row is dropped)."""
    from vllm_worker.transport import assembly
    from vllm_worker.worker import fetch
    from vllm_worker.worker.request_results import ArenaSpan, CaptureLog, RequestResults, StepArena

    monkeypatch.setattr(assembly, "BLOCK_BYTES", 3 * 64 * 2)  # three rows per copy job
    n_req, L, S, d = 7, 2, 9, 64
    arena = StepArena(n_req * L, pinned=False)
    data = torch.randn(S, n_req * L, d).to(torch.bfloat16)
    for k in range(S):
        rows, pos = arena.next(d, torch.bfloat16)
        rows.copy_(data[k])
        pos.fill_(k)
    logs = [CaptureLog(arena, l * n_req) for l in range(L)]
    pool = ResultPool()
    try:
        items, want = [], {}
        for r in (5, 0, 3, 6, 1):  # out of order, and requests 2 and 4 not in this fetch
            st = RequestResults([10, 20])
            st.segments = [ArenaSpan(logs[l], l, r, 1) for l in range(L)]
            n_pos = S - 1 if r == 3 else S
            items.append(({}, st, n_pos, [10, 20], {0: 0, 1: 1}))
            want[r] = torch.stack([data[:n_pos, l * n_req + r] for l in range(L)])
        timings = dict(fetch.FETCH_TIMINGS)
        out = assembly.assemble(items, pool, 4, fetch.executor, timings)
        for r, payload in zip((5, 0, 3, 6, 1), out):
            assert "error" not in payload and payload["layers"] == [10, 20]
            got = result_views.view(payload["pool"], torch.bfloat16)
            assert got.shape == want[r].shape and torch.equal(got, want[r]), r
    finally:
        pool.close()


def test_new_requests_take_releases_without_unmapping_and_fetches_unmap_removed_segments(monkeypatch):
    """`take_released(unmap=False)` (every new request) hands back released regions without a stat per mapped
    segment; the next plain `take_released` (a fetch) unmaps a segment its worker removed. The shared-memory
    directory is checked at most once per `shm.DIR_CHECK_S`; the VLLM_LENS_SHM setting on every call."""
    pool = ResultPool()
    try:
        desc = _write(pool, torch.ones(2, 64))
        got = result_views.view(desc, torch.float32)
        assert desc["path"] in result_views._maps
        del got
        gc.collect()
        pool.free(result_views.take_released({pool.id}, unmap=False))
        pool.trim(keep=0)  # the worker drops the segment (its file goes)
        assert not os.path.exists(desc["path"])
        assert result_views.take_released({pool.id}, unmap=False) == [] and desc["path"] in result_views._maps
        assert result_views.take_released({pool.id}) == [] and desc["path"] not in result_views._maps
    finally:
        pool.close()
    calls = []
    real_isdir = os.path.isdir
    monkeypatch.setattr(os.path, "isdir", lambda p: calls.append(p) or real_isdir(p))
    monkeypatch.setattr(shm, "_dir_checked", [-1e9, False])
    first = shm.host_id()
    assert first is not None and shm.host_id() == first and len(calls) == 1
    monkeypatch.setenv("VLLM_LENS_SHM", "0")
    assert shm.host_id() is None


def test_early_assembly_blocks_copy_every_row_to_its_place():
    """The early-assembly thread's copy plan (`EarlyAssembler._map` / `_jobs` / `_split`): requests of one
    destination segment at every layer make one strided block; two segments, a request without a region,
    a position outside its result and pieces cut for several threads all land each (request, layer,
    position) row exactly where the fetch-time layout puts it, and nothing else is written."""
    import threading

    import numpy as np

    from vllm_worker.transport import early

    L, R, S, d, n_max = 3, 5, 4, 16, 6
    seg = {0: np.zeros((200, d), np.int16), 1: np.zeros((200, d), np.int16)}
    fills = {k: np.zeros(200, dtype=bool) for k in seg}
    where = {0: (0, 10), 1: (0, 40), 2: (1, 0), 3: (1, 30)}  # request -> (segment, first row); 4: no region

    class St:
        pass

    sts = []
    for r in range(R):
        st = St()
        if r in where:
            k, first = where[r]
            dest = early.EarlyRegion(("seg%d" % k, first * d * 2, 0), d * 2, n_max, d, torch.bfloat16, [0, 1, 2], {})
            dest.out_of_slot = {0: 0, 1: 1, 2: 2}
            dest.rows, dest.fill = seg[k], fills[k]
            st.early, st.dest = State.HELD, dest
        else:
            st.early = State.OFF
        sts.append(st)

    class Arena:
        rows = L * R
        users = [(l * R + r, 1, sts[r], l) for l in range(L) for r in range(R)]
        early = None
        direct = None

    data = torch.arange(S * L * R * d, dtype=torch.int16).reshape(S, L * R, d).view(torch.bfloat16)
    pos = torch.arange(S).repeat_interleave(L * R).reshape(S, L * R).clone()
    pos[3, 1 * R + 3] = n_max  # request 3, layer 1, last step: outside its result
    asm = early.EarlyAssembler(lambda: None, {}, lambda n: None)
    asm._cv = threading.Condition()
    cmap = asm._map(Arena)
    assert cmap is not None and [b[0] for b in cmap[3]] == [0, 1] and all(b[4] == L for b in cmap[3])
    jobs: list = []
    marks: list = []
    nbytes = asm._jobs([data, pos, S], 0, S, cmap, jobs, marks)
    assert nbytes == (4 * L * S - 1) * d * 2
    assert not any(f.any() for f in fills.values())  # marked only once copied
    parts = early_maps.split(jobs, 3)
    assert len(parts) >= 3
    for part in parts:
        early_maps.run(part)
    for fill, idx in marks:
        fill[idx] = True
    src = data.view(torch.int16).numpy()
    want = {k: np.zeros((200, d), np.int16) for k in seg}
    for r, (k, first) in where.items():
        for l in range(L):
            for s in range(S):
                if (r, l, s) != (3, 1, 3):
                    want[k][first + l * n_max + s] = src[s, l * R + r]
                    assert fills[k][first + l * n_max + s]
    for k in seg:
        assert np.array_equal(seg[k], want[k])
    assert fills[0].sum() + fills[1].sum() == 4 * L * S - 1


class _Direct:
    """A direct-mode arena of R requests x L layers (one column each) over two segments; request 3's region
    comes after the first step. `dest(r)` is request r's region as the thread (or `take_now`) makes it."""

    L, R, d, n_max, S = 3, 4, 16, 6, 3
    where = {0: (0, 10), 1: (1, 0), 2: (1, 40), 3: (0, 100)}  # request -> (segment, first row)

    def __init__(self) -> None:
        import threading

        import numpy as np

        from vllm_worker.transport import early
        from vllm_worker.worker.request_results import StepArena

        L, R, d, S = self.L, self.R, self.d, self.S
        self.seg = {0: np.zeros((200, d), np.int16), 1: np.zeros((300, d), np.int16)}
        self.fills = {k: np.zeros(len(self.seg[k]), dtype=bool) for k in self.seg}
        self.sts = [type("St", (), {})() for _ in range(R)]
        for r, st in enumerate(self.sts):
            st.early, st.dest = (State.HELD, self.dest(r)) if r < 3 else (State.PENDING, None)
        self.arena = StepArena(L * R, False)
        self.arena.users = [(l * R + r, 1, self.sts[r], l) for l in range(L) for r in range(R)]
        self.asm = early.EarlyAssembler(lambda: None, {"direct_joins": 0}, lambda n: None)
        self.asm._cv = threading.Condition()
        self.data = torch.arange(S * L * R * d, dtype=torch.int16).reshape(S, L * R, d).view(torch.bfloat16)
        self.pos = torch.arange(S).repeat_interleave(L * R).reshape(S, L * R).clone()
        self.pos[2, 1 * R + 2] = self.n_max  # request 2, layer 1, last step: outside its result
        src = self.data.view(torch.int16).numpy()
        self.want = {k: np.zeros_like(self.seg[k]) for k in self.seg}
        for r, (k, first) in self.where.items():
            for l in range(L):
                for s in range(S):
                    if (r, l, s) != (2, 1, 2):
                        self.want[k][first + l * self.n_max + s] = src[s, l * R + r]

    def dest(self, r: int):
        from vllm_worker.transport import early

        k, first = self.where[r]
        d = self.d
        dest = early.EarlyRegion(("seg%d" % k, first * d * 2, 0), d * 2, self.n_max, d, torch.bfloat16, [0, 1, 2], {})
        dest.out_of_slot = {0: 0, 1: 1, 2: 2}
        dest.rows, dest.fill = self.seg[k], self.fills[k]
        dest.addr = self.seg[k].ctypes.data
        return dest

    def step(self, s: int):
        """Step `s` as the store files it: the offsets, and the GPU's writes (the host scatter here)."""
        from vllm_worker.worker import graph_kernels

        got = self.asm.direct_rows(self.arena, self.pos[s].numpy(), self.d, torch.bfloat16)
        assert got is not None and self.arena.direct is True
        origin, span, offs, _ = got
        assert origin == min(a.ctypes.data for a in self.seg.values())
        graph_kernels.host_scatter(self.data[s].view(torch.int16).numpy(), origin, span, offs)
        return got

    def thread_copies(self, cmap) -> int:
        """The thread's copies of every step's arena rows under plan `cmap`; the bytes it copied."""

        jobs: list = []
        marks: list = []
        n = self.asm._jobs([self.data, self.pos, self.S], 0, self.S, cmap, jobs, marks)
        for part in early_maps.split(jobs, 2):
            early_maps.run(part)
        for fill, idx in marks:
            fill[idx] = True
        return n


def test_direct_offsets_and_marks():
    """Direct mode's plan (`EarlyAssembler.direct_rows`, `graph_kernels.host_scatter`): the element offsets the GPU's
    kernel gets put every (request, layer, position) row of a step at its place in two separate segments (an
    origin and a span across both), rows outside a result are not written, and the step marks them written;
    a request without a region at the first step is copied by the thread (the thread's plan skips the
    others), and an arena turned back to host copies (a step from Python) copies them too."""
    import numpy as np

    from vllm_worker.worker.request_results import StepArena

    t = _Direct()
    L, d, S, seg = t.L, t.d, t.S, t.seg
    for s in range(S):
        _, _, offs, full = t.step(s)
        assert len(t.arena.members) == 3 and not full  # request 3 is not a member
        assert (offs < 0).sum() == L + (s == 2)  # request 3 at every layer, and the row outside
        if s == 0:  # its region, taken without the thread's notice (no `dmade`): it stays a host copy
            t.sts[3].early, t.sts[3].dest = State.HELD, t.dest(3)
    direct_only = {k: t.want[k].copy() for k in seg}
    direct_only[0][100 : 100 + L * t.n_max] = 0
    for k in seg:
        assert np.array_equal(seg[k], direct_only[k])
    assert t.fills[0].sum() + t.fills[1].sum() == 3 * L * S - 1  # marked by the steps
    # the thread's plan for a direct arena skips its members: it copies request 3 only
    assert t.thread_copies(t.asm._map(t.arena)) == L * S * d * 2
    for k in seg:
        assert np.array_equal(seg[k], t.want[k])
    # turned back to host copies (a step filed from Python): the members' rows are copied too
    for k in seg:
        seg[k][:] = 0
    t.arena.direct = False
    assert t.asm.direct_rows(t.arena, t.pos[0].numpy(), d, torch.bfloat16) is None
    assert t.thread_copies(t.asm._map(t.arena)) == (4 * L * S - 1) * d * 2
    for k in seg:
        assert np.array_equal(seg[k], t.want[k])
    # an arena whose every request is a member needs no host rows
    t.sts[3].early, t.sts[3].dest = State.OFF, None
    arena2 = StepArena(L * 3, False)
    arena2.users = [(l * 3 + r, 1, t.sts[r], l) for l in range(L) for r in range(3)]
    got = t.asm.direct_rows(arena2, t.pos[0].numpy()[: L * 3], d, torch.bfloat16)
    assert got is not None and got[3] is True


def test_direct_late_member_joins_and_keeps_its_host_copies():
    """A request whose region the thread makes after the arena's first step (`dmade`) joins its direct
    members at the next step: the GPU writes its rows from then on, the arena needs no host rows once every
    request is a member, and the thread still copies all of the late one's arena rows (its rows before the
    join are only there) but none of the first members'. Together: every row in place."""
    import numpy as np

    t = _Direct()
    L, d, S, seg = t.L, t.d, t.S, t.seg
    _, _, offs, full = t.step(0)
    assert len(t.arena.members) == 3 and not full and (offs < 0).sum() == L
    t.sts[3].early, t.sts[3].dest = State.HELD, t.dest(3)  # as the thread's `_regions` makes it
    t.asm.dmade += 1
    for s in (1, 2):
        _, _, offs, full = t.step(s)
        assert len(t.arena.members) == 4 and full and (offs < 0).sum() == (s == 2)
    assert t.asm._timings["direct_joins"] == 1 and t.arena.skip == t.arena.members - {id(t.sts[3].dest)}
    # the GPU wrote request 3's rows of steps 1 and 2; its step 0 is the thread's (from the arena rows)
    assert not seg[0][100 : 100 + L * t.n_max].reshape(L, t.n_max, d)[:, 0].any()
    assert t.fills[0][100 : 100 + L * t.n_max].reshape(L, t.n_max)[:, 1:3].all()
    assert t.thread_copies(t.asm._map(t.arena)) == L * S * d * 2  # request 3 only
    for k in seg:
        assert np.array_equal(seg[k], t.want[k])


def test_direct_regions_come_only_from_registered_segments():
    """`ResultPool(pin=...)`: every new segment is registered once (a refusal leaves it to host copies),
    `alloc_now` takes regions only from registered segments and never grows the pool, and a segment is
    unregistered before its pages are given back."""
    from vllm_worker.transport.result_pool import MIN_SEGMENT, ResultPool

    pinned: dict[int, int] = {}
    unpinned: list[int] = []
    refuse = [False]

    def pin(addr: int, size: int):
        if refuse[0]:
            raise RuntimeError("no")
        pinned[addr] = size
        return unpinned.append

    pool = ResultPool(pin=pin)
    try:
        assert pool.alloc_now(4096) is None  # nothing yet, and nothing is grown for it
        assert pool.status()["segments"] == 0
        path, off, size, _ = pool.alloc(4096)
        got = pool.alloc_now(8192, align=8192)
        assert got is not None and got[0] == path and got[1] % 8192 == 0 and got[3] in pinned
        assert pool.status()["pinned_segments"] == 1 and pool.status()["direct_allocs"] == 1
        refuse[0] = True
        big = pool.alloc(2 * MIN_SEGMENT)  # a second segment, refused by `pin`: used by host copies only
        assert big is not None and big[0] != path and pool.status()["pinned_segments"] == 1
        pool.free([(big[0], big[1])])
        pool.trim(keep=0)  # the refused segment goes (never registered: nothing to unregister)
        assert unpinned == []
        assert pool.alloc_now(3 * MIN_SEGMENT) is None  # too large for the registered segment
    finally:
        pool.close()
    assert unpinned == list(pinned)  # closed: the registered segment was unregistered


def test_a_free_never_closes_segments_in_the_callers_thread(monkeypatch):
    """`free` runs in the step thread (under the store's lock) and in the early-assembly thread (under its
    lock): dropping a segment (unregistering it from the GPU, punching its pages, unmapping) is the pool's
    own thread's work, after the free returned."""
    import threading

    closed: list[str] = []
    real_close = result_pool._Segment.close
    monkeypatch.setattr(
        result_pool._Segment, "close", lambda seg: closed.append(threading.current_thread().name) or real_close(seg)
    )
    monkeypatch.setenv("VLLM_LENS_SHM_POOL_GB", "0")  # keep nothing free: the free drops the segment
    pool = ResultPool()
    try:
        path, off, _, _ = pool.alloc(1 << 20)
        assert pool.free([(path, off)]) == 1
        assert threading.current_thread().name not in closed  # not in this thread (the pool's may be at it)
        deadline = time.time() + 10
        while not closed and time.time() < deadline:
            time.sleep(0.01)
        assert closed and threading.current_thread().name not in closed
        assert pool.size == 0 and not os.path.exists(path)
    finally:
        pool.close()


def test_an_alloc_waiting_for_growth_sleeps_on_a_condition_not_a_poll(monkeypatch):
    """While the pool's growing thread adds room, `alloc` waits for it to say so (no 1 ms polling)."""
    import threading

    real_sleep, real_new = time.sleep, ResultPool._new_segment
    polls: list[float] = []

    def counted_sleep(s: float) -> None:
        if threading.current_thread() is threading.main_thread():
            polls.append(s)
        real_sleep(s)

    def slow_new(self, size):
        real_sleep(0.3)
        return real_new(self, size)

    monkeypatch.setattr(ResultPool, "_new_segment", slow_new)
    monkeypatch.setattr(result_pool.time, "sleep", counted_sleep)
    pool = ResultPool()
    try:
        assert pool.expect(8 << 20) == 8 << 20  # the growing thread starts
        t = time.perf_counter()
        got = pool.alloc(8 << 20, expected=8 << 20)
        assert got is not None and time.perf_counter() - t >= 0.2
        assert polls == [] and pool.stats["sync_grows"] == 0
    finally:
        pool.close()
