"""Where results wait in a worker until the frontend fetches them: captures (leaving the GPU while
generation goes on), hook state and the first failure of each request.

On CUDA a step's captures are gathered into one device tensor and copied to pinned host memory on a
side stream that waits for the step's kernels: no synchronisation in the step, and the device copy is
released as soon as the transfer ends (`record_stream`). Only a fetch waits for transfers in flight.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import numpy as np
import torch

from vllm_worker.compat.version import direct_writes_on
from vllm_worker.counters import FETCH_TIMINGS
from vllm_worker.envs import get, given, limit
from vllm_worker.protocol import errors
from vllm_worker.transport import early, result_pool
from vllm_worker.transport.early_regions import State
from vllm_worker.transport.lock_order import LockOrder, Ordered
from vllm_worker.transport.result_pool import ResultPool
from vllm_worker.worker import faults, ready_probes
from vllm_worker.worker import fetch as fetch_mod
from vllm_worker.worker.plan import StepPlan
from vllm_worker.worker.request_results import ArenaSpan, CaptureLog, RequestResults, StepArena

logger = logging.getLogger("vllm_worker")


class CaptureStore:
    def __init__(self, device: torch.device) -> None:
        self._stores: dict[tuple[str, int], RequestResults] = {}
        self._evicted: set[str] = set()
        self.stored_bytes = 0
        self.lock = Ordered(threading.Lock(), LockOrder.STORE)  # (before early's condition, before the pool's)
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ready_stream: torch.cuda.Stream | None = None  # (`prepare_ready` while a step runs)
        self._pool: ResultPool | None = None
        # copies captures into their pool regions while requests run (`transport.early`)
        self.early = early.EarlyAssembler(
            lambda: self._pool, FETCH_TIMINGS, fetch_mod.executor, fetch_mod.max_threads, faults.check
        )
        # the GPU writes graph-path steps' rows into their regions itself (`early`, direct mode): on CUDA
        # decided here, once (`compat.version.direct_writes_on`) (the pool's segments are registered as they are made); on CPU when asked, and
        # only when set (`_direct_on`)
        self.direct = self.side is not None and direct_writes_on()

    @property
    def pool(self) -> ResultPool | None:
        """This worker's shared-memory result pool (made on first use; None when turned off)."""
        if self._pool is None and result_pool.enabled():
            pin = _cuda_pin(torch.cuda.current_device()) if self.side is not None and self.direct else None
            self._pool = ResultPool(pin=pin)
        return self._pool

    def release(self, released: list | None) -> int:
        """Pool regions the frontend is done with (with a fetch, a new request, or on their own)."""
        return self._pool.free(released) if released and self._pool is not None else 0

    def pool_status(self) -> dict[str, Any] | None:
        return self._pool.status() if self._pool is not None else None

    def __len__(self) -> int:
        return len(self._stores)

    def probe_records(self) -> int:
        """Probe score records (one per site and batch composition: `worker.step_records`) the stored
        requests hold on the device (`lens_status` "probe_score_chunks")."""
        with self.lock:
            held = {id(e[0].record) for st in self._stores.values() for e in st.probe_filed}
            return len(held)

    def add(self, key: str, child: int, store: RequestResults) -> None:
        with self.lock:
            self._stores[(key, child)] = store

    def peek(self, key: str, child: int) -> RequestResults | None:
        """A running (or finished, not yet fetched) request's results, left in place."""
        with self.lock:
            return self._stores.get((key, child))

    # ------------------------------------------------------------ per plan / per step

    def open_plan(self, plan: StepPlan) -> None:
        """A new batch composition: one arena, a log per captured layer (columns in `plan.capture` order),
        one segment per (request, layer)."""
        plan.logs = {}
        total = sum(e - s for _, items in plan.capture.values() for _, s, e in items)
        plan.arena = StepArena(total, self.side is not None)
        col = 0
        users = plan.arena.users
        on = bool(get("VLLM_LENS_EARLY_ASSEMBLY")) and not self.early.broken
        with self.lock:
            for layer, (_, items) in plan.capture.items():
                log = plan.logs[layer] = CaptureLog(plan.arena, col)
                off = 0
                for r, s, e in items:
                    st = r.store
                    assert st is not None  # a capturing request has a store (admission)
                    slot = r.capture_slot[layer]
                    st.segments.append(ArenaSpan(log, slot, off, e - s))
                    log.refs += 1
                    if self.early.decide(st, on):  # (decided once, at the request's first plan)
                        users.append((col + off, e - s, st, slot))
                    off += e - s
                log.rows = off
                col += off

    def step_slot(self, plan: StepPlan, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Host (rows, d) / (rows,) views where this step's captures go (`file_step` once written)."""
        assert plan.arena is not None  # `open_plan` made it
        return plan.arena.next(d, dtype)

    def finish_step(self, plan: StepPlan) -> None:
        """Python path: the step's captured rows (kept per layer by the taps) to the host, then filed.
        Layer by layer into the step's host rows: an all-layer prefill holds GBs of rows on the device
        already, and gathering them into one tensor first would need as much again."""
        by_layer = dict(plan.captured)
        parts = [by_layer[layer] for layer in plan.capture]
        all_idx = torch.cat([plan.capture[layer][0] for layer in plan.capture])
        assert plan.positions is not None  # set by begin_step on the Python path
        pos = plan.positions.index_select(0, all_idx)
        host, hpos = self.step_slot(plan, parts[0].shape[-1], parts[0].dtype)
        side = self.side
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(pos.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            o = 0
            for t in parts:
                host[o : o + t.shape[0]].copy_(t, non_blocking=side is not None)
                o += t.shape[0]
            hpos.copy_(pos, non_blocking=side is not None)
        if side is not None:
            for t in [*parts, pos]:
                t.record_stream(side)
        self.file_step(plan, host)

    def file_graph_step(self, plan: StepPlan, g: Any, base: int, n: int, pos: np.ndarray) -> None:
        """Graph path: the step's `n` staged rows from ring row `base` (at positions `pos`) to the plan's
        arena (`graph.GraphTaps.copy_out`) and, in direct mode, into their requests' regions, then filed; a
        step whose every row is written directly gets no arena rows. Under the store's lock, so that no
        region is freed or claimed between its offsets being read and its write being queued."""
        arena = plan.arena
        assert arena is not None  # `open_plan` made it
        with self.lock:
            direct = None
            on = self._direct_on(g)
            self.early.direct = on
            if on and arena.users and self._pool is not None:
                t = time.perf_counter()
                direct = self.early.direct_rows(arena, pos, g.d, g.dtype)
                FETCH_TIMINGS["direct_s"] += time.perf_counter() - t
            if direct is None and arena.direct:
                arena.direct = False  # (direct mode went off): its members' rows are copied on the host again
            host = None
            if direct is None or not direct[3]:
                host, hpos = self.step_slot(plan, g.d, g.dtype)
                hpos.numpy()[:] = pos
            try:
                g.copy_out(base, n, host, direct)
            except Exception as e:
                if direct is not None:  # never again for this worker; this step's requests fail (the caller)
                    logger.error(
                        "inspect-lens: a direct write failed (%s: %s); direct writes are off", type(e).__name__, e
                    )
                    self.direct = False
                    self.early.direct = False
                    arena.direct = False
                raise
            event = self._copied(arena)  # (a direct step has users: this is the writes' fence too)
            if direct is not None:
                self.early.fence = event
                FETCH_TIMINGS["direct_steps"] += 1
                FETCH_TIMINGS["direct_rows"] += int((direct[2] >= 0).sum())
            if host is None:
                arena.direct_steps += 1
                FETCH_TIMINGS["direct_only_steps"] += 1
            self._file(plan, g.d * g.stage.element_size(), event, queue=host is not None)

    def _direct_on(self, g: Any) -> bool:
        """Direct writes this step: on CUDA when set at start-up and the kernel is ready; on CPU (the host
        scatter, for tests) only when the variable is set to 1, read per step."""
        if self.side is not None:
            return self.direct and bool(getattr(g, "direct_ok", False))
        return bool(given("VLLM_LENS_DIRECT_POOL"))

    def file_step(self, plan: StepPlan, host: torch.Tensor) -> None:
        """Account a step whose rows are (or are being copied) in `host` (`fetch` waits for copies)."""
        arena = plan.arena
        assert arena is not None  # `open_plan` made it
        event = self._copied(arena)
        with self.lock:
            arena.direct = False  # its rows reach direct regions by host copies from now on
            self._file(plan, host.shape[-1] * host.element_size(), event)

    def _copied(self, arena: Any) -> Any:
        """An event after the step's copies on the side stream (early assembly waits for it), or None."""
        if not arena.users or self.side is None:
            return None
        # a blocking-sync event: the thread waiting on it sleeps instead of spinning in the driver beside
        # the step loop's launches
        event = torch.cuda.Event(blocking=True)
        event.record(self.side)
        return event

    def _file(self, plan: StepPlan, row: int, event: Any, queue: bool = True) -> None:
        """(lock held.) `row`: bytes of one captured row; `queue`: the step has arena rows for early
        assembly."""
        arena = plan.arena
        assert arena is not None
        for log in plan.logs.values():
            nb = log.rows * row
            log.nbytes += nb
            self.stored_bytes += nb
        self._evict_if_needed()
        if arena.users and queue:
            self.early.filed(arena, event)

    def _release(self, st: RequestResults) -> None:
        if st.early not in (State.UNDECIDED, State.OFF):
            self.early.kill(st)  # its early region, if any, goes back to the pool
        expected = self.early.take_expected(st)
        if expected and self._pool is not None:
            self._pool.unexpect(expected)
        for seg in st.segments:
            seg.log.refs -= 1
            if seg.log.refs == 0:
                self.stored_bytes -= seg.log.nbytes
                seg.log.nbytes, seg.log.arena = 0, None  # the arena goes with its last log
        st.segments = []

    def _evict_if_needed(self) -> None:
        # past the cap the oldest are dropped and a later fetch of them reports it (never a silent empty result)
        cap = limit("VLLM_LENS_MAX_STORED_GB")
        while self.stored_bytes > cap and self._stores:
            key = next(iter(self._stores))
            self._release(self._stores.pop(key))
            self._evicted.add(key[0])
            logger.error("inspect-lens: capture store over VLLM_LENS_MAX_STORED_GB; dropped request %s", key[0])

    # ------------------------------------------------------------ fetch

    def fetch(
        self,
        wanted: list[tuple[str, dict[int, int]]],
        reporting: bool,
        layer_ids: list[int],
        assemble_saved: Any,
        use_shm: bool = False,
        released: list | None = None,
    ) -> dict[str, Any]:
        """{key: {child: payload}} for this rank's layers; pops what it returns. A rank that does not
        report (TP rank > 0: hooks ran there too, on the same replicated stream) only drops. `use_shm`:
        capture tensors go into the shared-memory result pool (`result_pool`); `released`: pool regions
        the frontend is done with."""
        out: dict[str, Any] = {}
        self.release(released)
        t0 = time.perf_counter()
        if self.side is not None:
            self.side.synchronize()
        t1 = time.perf_counter()
        FETCH_TIMINGS["wait_copies_s"] += t1 - t0
        # the copies of steps the early-assembly thread has not done yet: every step of a finished
        # request was filed before its fetch
        FETCH_TIMINGS["early_flush_s"] += self.early.flush()
        t1 = time.perf_counter()
        try:
            return self._fetch(wanted, reporting, layer_ids, assemble_saved, use_shm, out)
        finally:
            FETCH_TIMINGS["assemble_s"] += time.perf_counter() - t1

    def _fetch(
        self, wanted: list, reporting: bool, layer_ids: list[int], assemble_saved: Any, use_shm: bool, out: dict
    ) -> dict[str, Any]:
        with self.lock:
            todo: list[tuple[str, int, RequestResults, int]] = []
            for key, children in wanted:
                if reporting and key in self._evicted:
                    self._evicted.discard(key)
                    out[key] = {
                        "error": errors.failure(
                            "limit",
                            "captures were dropped: the worker's store exceeded "
                            "VLLM_LENS_MAX_STORED_GB before they were fetched",
                            "store",
                        )
                    }
                    continue
                for child, n_pos in children.items():
                    st = self._stores.pop((key, int(child)), None)
                    if st is not None:
                        todo.append((key, int(child), st, int(n_pos)))
            claimed: dict[int, early.EarlyRegion] = {}
            if reporting and use_shm:
                claimed = self.early.claim([st for _, _, st, _ in todo])
                if claimed:
                    self.early.quiesce()  # no copy into the claimed regions is in flight any more
                    if self.side is not None and any(d.addr for d in claimed.values()):
                        self.side.synchronize()  # ... nor a GPU write queued before the claim
            if reporting:
                payloads = fetch_mod.assemble_all(
                    todo, layer_ids, assemble_saved, self.pool if use_shm else None, self.early, claimed
                )
                for (key, child, _, _), payload in zip(todo, payloads):
                    out.setdefault(key, {})[child] = payload
            for _, _, st, _ in todo:
                self._release(st)
        return out

    def prepare_ready(self) -> int:
        """The engine has nothing new to run: make the probe payloads of the finished requests held here
        (`ready_probes`). While the device still runs an earlier step (vLLM schedules ahead), only those
        whose records have run, read on a stream of their own (the step's stream would make the reads wait
        for it, and the capture stream may wait for it too), until the step ends."""
        step = None if self.side is None else torch.cuda.current_stream(self.side.device)
        if step is None or step.query():
            with self.lock:
                return ready_probes.prepare(list(self._stores.values()))
        if self._ready_stream is None:
            self._ready_stream = torch.cuda.Stream(step.device)
        with self.lock, torch.cuda.stream(self._ready_stream):
            return ready_probes.prepare(list(self._stores.values()), running=lambda: not step.query())

    def drop(self, keys: list[str]) -> int:
        with self.lock:
            keys_set = set(keys)
            gone = [k for k in self._stores if k[0] in keys_set]
            for k in gone:
                self._release(self._stores.pop(k))
            return len(gone)


# Result-pool segments are registered in pieces of this size: registering holds the driver, and the step
# thread's launches wait for it (docs/decisions.md), so the waits stay short.
PIN_PIECE = 256 << 20


def _cuda_pin(device: int) -> Any:
    """Registers result-pool segments with CUDA (direct mode): `pin(address, size)` -> its unregister."""
    cudart = torch.cuda.cudart()

    def pin(addr: int, size: int) -> Any:
        torch.cuda.set_device(device)  # (the pool's growing thread: the worker's device, not device 0)
        done: list[int] = []

        def unpin(_: int) -> None:
            torch.cuda.set_device(device)
            for a in done:
                cudart.cudaHostUnregister(a)

        for a in range(addr, addr + size, PIN_PIECE):
            rc = int(cudart.cudaHostRegister(a, min(PIN_PIECE, addr + size - a), 3))  # portable | mapped
            if rc != 0:
                unpin(addr)
                raise RuntimeError(f"cudaHostRegister returned {rc}")
            done.append(a)
            time.sleep(0.0005)  # (the step thread gets the driver between pieces)
        return unpin

    return pin
