"""Where results wait in a worker until the frontend fetches them: captures (leaving the GPU while
generation goes on), hook state and the first failure of each request.

On CUDA a step's captures are gathered into one device tensor and copied to pinned host memory on a
side stream that waits for the step's kernels: no synchronisation in the step, and the device copy is
released as soon as the transfer ends (`record_stream`). Only a fetch waits for transfers in flight.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .plan import StepPlan
from . import faults, shm
from .limits import limit
from .wire import dtype_name, tensor_to_bytes

logger = logging.getLogger("vllm_worker")

# Captures kept in the worker until fetched. Past the cap the oldest are dropped and a later fetch of
# them reports it (an error, never a silent empty result).
MAX_STORED_BYTES = limit("VLLM_LENS_MAX_STORED_GB")

# Shared-memory result files made ahead of fetches (`Preparer`), at most this many bytes at a time.
PREPARE_BYTES = int(float(os.environ.get("VLLM_LENS_SHM_PREPARE_GB", "4")) * (1 << 30))
# ... and only for requests whose longest possible result is at most this (a request without max_tokens
# may allow thousands of positions it will never reach: not worth reserving)
PREPARE_MAX_REQUEST_BYTES = int(float(os.environ.get("VLLM_LENS_SHM_PREPARE_MAX_MB", "512")) * (1 << 20))

PREPARE_STATS = {"made": 0, "used": 0, "discarded": 0}  # diagnostics (in `status`)

# At most this many threads assemble a fetch's requests; one per ASSEMBLY_BYTES_PER_THREAD of results.
# Measured on the H200 host (bench/results/2026-12-01-h200-s6.md): per-request assembly is mostly Python,
# so threads fight over the GIL — 331 MB (256 requests, one layer) took 0.17 s on one thread and 0.38 s
# on eight; 10.5 GB (all layers, page population bound) was fastest on four (5.9 s; 8.1 s on eight).
ASSEMBLY_THREADS = int(os.environ.get("VLLM_LENS_ASSEMBLY_THREADS", str(min(4, os.cpu_count() or 1))))
ASSEMBLY_BYTES_PER_THREAD = 2 << 30


def assembly_threads(nbytes: int) -> int:
    return max(1, min(ASSEMBLY_THREADS, nbytes // ASSEMBLY_BYTES_PER_THREAD))


def _pool(threads: int) -> Any:
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lens-assemble")


# Diagnostics (reported by `status`, read by benchmarks): cumulative seconds in fetches.
FETCH_TIMINGS = {"wait_copies_s": 0.0, "assemble_s": 0.0,
                 # summed over assembly threads: waiting for prepared files, allocating unprepared ones, copying
                 "take_wait_s": 0.0, "alloc_s": 0.0, "copy_s": 0.0, "late_prepared": 0,
                 "arena_alloc_s": 0.0}  # host memory for steps' captures, allocated in the step


class StepArena:
    """Host memory for the captured rows of every step run with one plan (one batch composition): step
    after step in chunks of shape (steps, rows, d), so a request's rows at one layer across all decode
    steps are one strided slice — nothing to stack at fetch. Chunks double (1, 2, 4 … 64 steps); on CUDA
    they are pinned (device copies land in them asynchronously) and come from torch's caching host
    allocator, so a steady workload stops allocating."""

    __slots__ = ("rows", "pinned", "chunks")
    MAX_CHUNK_STEPS = 64

    def __init__(self, rows: int, pinned: bool) -> None:
        self.rows = rows
        self.pinned = pinned
        self.chunks: list[list] = []  # [data (steps, rows, d), positions (steps, rows), steps filled]

    def next(self, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, d) and (rows,) host views for the next step."""
        if not self.chunks or self.chunks[-1][2] == self.chunks[-1][0].shape[0]:
            t = time.perf_counter()
            c = min(self.MAX_CHUNK_STEPS, 1 << len(self.chunks))
            self.chunks.append([torch.empty((c, self.rows, d), dtype=dtype, pin_memory=self.pinned),
                                torch.empty((c, self.rows), dtype=torch.int64, pin_memory=self.pinned), 0])
            FETCH_TIMINGS["arena_alloc_s"] += time.perf_counter() - t
        ch = self.chunks[-1]
        k = ch[2]
        ch[2] += 1
        return ch[0][k], ch[1][k]

    def parts(self, col: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(positions (steps, n), rows (steps, n, d)) per chunk, for columns col:col+n."""
        return [(pos[:f, col:col + n], data[:f, col:col + n]) for data, pos, f in self.chunks if f]


class CaptureLog:
    """One layer's columns of a plan's arena: shared by the plan's requests, each reading its own row
    range (`Segment`). Filing a step is O(layers), not O(requests)."""

    __slots__ = ("arena", "col", "refs", "nbytes")

    def __init__(self, arena: StepArena, col: int) -> None:
        self.arena: StepArena | None = arena
        self.col = col  # first column of this layer in the arena's rows
        self.refs = 0  # segments still to be fetched or dropped
        self.nbytes = 0


@dataclass
class Segment:
    log: CaptureLog
    slot: int  # index of the layer in the request's capture list
    offset: int  # first row of the request inside each of the log's blocks
    n: int


@dataclass
class Store:
    """Everything a request hands back: captures, hook state, and the first failure."""

    layers: list[int]
    segments: list[Segment] = field(default_factory=list)
    saved: list[dict] = field(default_factory=list)
    error: str | None = None
    nonfinite: dict = field(default_factory=dict)  # hook -> device flag: it returned NaN/inf (not applied)
    prepared: Any = None  # Future of a (tensor, path) shared-memory result file made ahead (`Preparer`)
    prepared_bytes: int = 0


class Preparer:
    """Shared-memory result files made and faulted in while the GPU generates. Materialising fresh
    memory for hundreds of MB of captures was most of the time between the last step and the results
    (page population, measured 3x the copy itself); done ahead, on a background thread (the syscalls and
    page touching release the GIL), the fetch only copies. Sized for the request's longest possible
    output (prompt + max_tokens); the result is written as a prefix and the file truncated to it.
    Bounded by `VLLM_LENS_SHM_PREPARE_GB` of files not yet fetched."""

    def __init__(self) -> None:
        self.bytes = 0
        self._lock = threading.Lock()
        self._pool: Any = None

    def prepare(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Any, int]:
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            if nbytes == 0 or nbytes > PREPARE_MAX_REQUEST_BYTES or self.bytes + nbytes > PREPARE_BYTES:
                return None, 0
            self.bytes += nbytes
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lens-shm-prepare")
            PREPARE_STATS["made"] += 1
        return self._pool.submit(_make_prepared, shape, dtype), nbytes

    def take(self, st: "Store") -> tuple[torch.Tensor, str] | None:
        """The request's prepared file (waits if it is still being made); the caller owns it."""
        fut, st.prepared = st.prepared, None
        if fut is None:
            return None
        with self._lock:
            self.bytes -= st.prepared_bytes
        if not fut.done():
            FETCH_TIMINGS["late_prepared"] += 1
        return fut.result()

    def release(self, st: "Store") -> None:
        """The request will not use its prepared file: remove it (once made)."""
        got = self.take(st)
        if got is not None:
            shm.discard(got[1])
            PREPARE_STATS["discarded"] += 1


def _make_prepared(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, str] | None:
    got = shm.alloc(shape, dtype)
    if got is not None:
        flat = got[0].view(-1)
        flat[:: max(1, 4096 // flat.element_size())].zero_()  # fault every page in now
    return got


class CaptureStore:
    def __init__(self, device: torch.device) -> None:
        self._stores: dict[tuple[str, int], Store] = {}
        self._evicted: set[str] = set()
        self.stored_bytes = 0
        self.lock = threading.Lock()
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.preparer = Preparer()

    def __len__(self) -> int:
        return len(self._stores)

    def add(self, key: str, child: int, store: Store) -> None:
        with self.lock:
            self._stores[(key, child)] = store

    # ------------------------------------------------------------ per plan / per step

    def open_plan(self, plan: StepPlan) -> None:
        """A new batch composition: one arena, a log per captured layer (columns in `plan.capture` order),
        one segment per (request, layer)."""
        plan.logs = {}
        total = sum(e - s for _, items in plan.capture.values() for _, s, e in items)
        plan.arena = StepArena(total, self.side is not None)
        col = 0
        with self.lock:
            for layer, (_, items) in plan.capture.items():
                log = plan.logs[layer] = CaptureLog(plan.arena, col)
                off = 0
                for r, s, e in items:
                    r.store.segments.append(Segment(log, r.capture_slot[layer], off, e - s))
                    log.refs += 1
                    off += e - s
                col += off

    def step_slot(self, plan: StepPlan, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Host (rows, d) / (rows,) views where this step's captures go (`file_step` once written)."""
        return plan.arena.next(d, dtype)

    def finish_step(self, plan: StepPlan) -> None:
        """Python path: the step's captured rows (kept per layer by the taps) to the host, then filed."""
        by_layer = dict(plan.captured)
        dev = torch.cat([by_layer[layer] for layer in plan.capture])
        all_idx = torch.cat([plan.capture[layer][0] for layer in plan.capture])
        pos = plan.positions.index_select(0, all_idx)
        host, hpos = self.step_slot(plan, dev.shape[-1], dev.dtype)
        if self.side is None:
            host.copy_(dev)
            hpos.copy_(pos)
        else:
            side = self.side
            side.wait_stream(torch.cuda.current_stream(dev.device))
            with torch.cuda.stream(side):
                host.copy_(dev, non_blocking=True)
                hpos.copy_(pos, non_blocking=True)
            dev.record_stream(side)
            pos.record_stream(side)
        self.file_step(plan, host)

    def file_step(self, plan: StepPlan, host: torch.Tensor) -> None:
        """Account a step whose rows are (or are being copied) in `host` (`fetch` waits for copies)."""
        row = host.shape[-1] * host.element_size()
        with self.lock:
            for layer, (_, items) in plan.capture.items():
                nb = sum(e - s for _, s, e in items) * row
                plan.logs[layer].nbytes += nb
                self.stored_bytes += nb
            self._evict_if_needed()

    def _release(self, st: Store) -> None:
        if st.prepared is not None:
            self.preparer.release(st)
        for seg in st.segments:
            seg.log.refs -= 1
            if seg.log.refs == 0:
                self.stored_bytes -= seg.log.nbytes
                seg.log.nbytes, seg.log.arena = 0, None  # the arena goes with its last log
        st.segments = []

    def _evict_if_needed(self) -> None:
        while self.stored_bytes > MAX_STORED_BYTES and self._stores:
            key = next(iter(self._stores))
            self._release(self._stores.pop(key))
            self._evicted.add(key[0])
            logger.error("inspect-lens: capture store over VLLM_LENS_MAX_STORED_GB; dropped request %s", key[0])

    # ------------------------------------------------------------ fetch

    def fetch(self, wanted: list[tuple[str, dict[int, int]]], reporting: bool,
              layer_ids: list[int], assemble_saved: Any, use_shm: bool = False) -> dict[str, Any]:
        """{key: {child: payload}} for this rank's layers; pops what it returns. A rank that does not
        report (TP rank > 0: hooks ran there too, on the same replicated stream) only drops. `use_shm`:
        capture tensors go through shared-memory files (see `shm`)."""
        out: dict[str, Any] = {}
        t0 = time.perf_counter()
        if self.side is not None:
            self.side.synchronize()
        t1 = time.perf_counter()
        FETCH_TIMINGS["wait_copies_s"] += t1 - t0
        try:
            return self._fetch(wanted, reporting, layer_ids, assemble_saved, use_shm, out)
        finally:
            FETCH_TIMINGS["assemble_s"] += time.perf_counter() - t1

    def _fetch(self, wanted: list, reporting: bool, layer_ids: list[int], assemble_saved: Any, use_shm: bool,
               out: dict) -> dict[str, Any]:
        with self.lock:
            todo: list[tuple[str, int, Store, int]] = []
            for key, children in wanted:
                if reporting and key in self._evicted:
                    self._evicted.discard(key)
                    out[key] = {"error": "captures were dropped: the worker's store exceeded "
                                         "VLLM_LENS_MAX_STORED_GB before they were fetched"}
                    continue
                for child, n_pos in children.items():
                    st = self._stores.pop((key, int(child)), None)
                    if st is not None:
                        todo.append((key, int(child), st, int(n_pos)))
            if reporting:
                payloads = self._assemble_all(todo, layer_ids, assemble_saved, use_shm, self.preparer)
                for (key, child, _, _), payload in zip(todo, payloads):
                    out.setdefault(key, {})[child] = payload
            for _, _, st, _ in todo:
                self._release(st)
        return out

    @staticmethod
    def _assemble_all(todo: list, layer_ids: list[int], assemble_saved: Any, use_shm: bool,
                      preparer: Preparer) -> list:
        """Large fetches are assembled in a few parallel threads (`assembly_threads`): after a large batch
        this is most of the time between the last step and the results."""
        jobs = [lambda st=st, n=n: _assemble_or_error(st, n, layer_ids, assemble_saved, use_shm, preparer)
                for _, _, st, n in todo]
        threads = assembly_threads(sum(_result_bytes(st, n) for _, _, st, n in todo))
        if len(todo) < 2 or threads <= 1:
            return [job() for job in jobs]
        with _pool(threads) as pool:
            return list(pool.map(lambda job: job(), jobs))

    def drop(self, keys: list[str]) -> int:
        with self.lock:
            keys_set = set(keys)
            gone = [k for k in self._stores if k[0] in keys_set]
            for k in gone:
                self._release(self._stores.pop(k))
            return len(gone)


def _assemble_or_error(st: Store, n_pos: int, layer_ids: list[int], assemble_saved: Any, use_shm: bool,
                       preparer: Preparer) -> dict[str, Any]:
    """One request's payload; a failure of our own code here is that request's error, not the fetch's."""
    try:
        if st.layers:
            faults.check("assemble")
        return _assemble(st, n_pos, layer_ids, assemble_saved, use_shm, preparer)
    except Exception as e:  # noqa: BLE001
        logger.error("inspect-lens: assembling a request's results failed: %s: %s", type(e).__name__, e)
        return {"error": f"inspect-lens internal error while assembling results: {type(e).__name__}: {e}"}


def _result_bytes(st: Store, n_pos: int) -> int:
    """Size of a request's assembled captures (0 without any)."""
    for seg in st.segments:
        arena = seg.log.arena
        if arena is not None and arena.chunks:
            data = arena.chunks[0][0]
            return len(st.layers) * n_pos * data.shape[-1] * data.element_size()
    return 0


def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (16-bit floats as int16), for the assembly copies: numpy copies
    are single-threaded and release the GIL. (On the H200 host this did not by itself change the
    assembly time — the thread count did, see `assembly_threads`.)"""
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.numpy()


def _prepared_view(got: tuple[torch.Tensor, str] | None, shape: tuple[int, ...],
                   dtype: torch.dtype) -> tuple[torch.Tensor, str] | None:
    """The prefix of a prepared file as a `shape` tensor, or None (and the file removed) if it does not fit."""
    if got is None:
        return None
    t, path = got
    numel = int(np.prod(shape))
    if t.dtype != dtype or t.dim() != 3 or t.shape[0] != shape[0] or t.shape[2] != shape[2] or t.shape[1] < shape[1]:
        shm.discard(path)
        return None
    return t.view(-1)[:numel].view(shape), path


def _assemble(st: Store, n_pos: int, layer_ids: list[int], assemble_saved: Any,
              use_shm: bool = False, preparer: Preparer | None = None) -> dict[str, Any]:
    payload: dict[str, Any] = {}
    if st.error is None and st.nonfinite:
        bad = [where for where, flag in st.nonfinite.items() if bool(flag)]
        if bad:
            st.error = (f"{bad[0]} returned NaN or inf values; they were not written into the stream "
                        f"(hooks that did: {bad})")
    if st.error is not None:
        payload["error"] = st.error
    if st.saved:
        payload["hooks"] = assemble_saved(st.saved)
    if not st.layers:
        return payload
    mine = [l for l in st.layers if l in layer_ids]
    out_of_slot = {st.layers.index(l): i for i, l in enumerate(mine)}
    parts = [(out_of_slot[seg.slot], pos, rows) for seg in st.segments
             if seg.log.arena is not None and seg.slot in out_of_slot
             for pos, rows in seg.log.arena.parts(seg.log.col + seg.offset, seg.n)]
    if not parts:
        payload.setdefault("error", "no positions were captured")
        return payload
    d, dtype = parts[0][2].shape[-1], parts[0][2].dtype
    shape = (len(mine), n_pos, d)
    t0 = time.perf_counter()
    got = preparer.take(st) if preparer is not None and st.prepared is not None else None
    t1 = time.perf_counter()
    mapped = None
    if use_shm:
        mapped = _prepared_view(got, shape, dtype)
        if mapped is not None:
            os.truncate(mapped[1], int(np.prod(shape)) * mapped[0].element_size())  # the unused tail goes
            PREPARE_STATS["used"] += 1
        else:
            mapped = shm.alloc(shape, dtype)
    elif got is not None:
        shm.discard(got[1])
    t = mapped[0] if mapped is not None else torch.zeros(shape, dtype=dtype)
    t2 = time.perf_counter()
    FETCH_TIMINGS["take_wait_s"] += t1 - t0
    FETCH_TIMINGS["alloc_s"] += t2 - t1
    filled = np.zeros((len(mine), n_pos), dtype=bool)
    dst = _np(t)
    for slot, pos, rows in parts:  # pos (steps, n), rows (steps, n, d)
        p = _np(pos).ravel()
        src = _np(rows)
        if len(p) and p[0] >= 0 and p[-1] - p[0] == len(p) - 1 and p[-1] < n_pos and \
                (len(p) < 3 or np.array_equal(np.diff(p), np.ones(len(p) - 1, dtype=p.dtype))):
            # one request's decode steps / prefill chunk: one block copy
            np.copyto(dst[slot, p[0]:p[-1] + 1].reshape(src.shape), src)
            filled[slot, p[0]:p[-1] + 1] = True
            continue
        src = src.reshape(-1, d)
        keep = p < n_pos
        if not keep.all():
            p, src = p[keep], src[keep]
        dst[slot, p] = src
        filled[slot, p] = True
    FETCH_TIMINGS["copy_s"] += time.perf_counter() - t2
    missing = [(l, int(np.flatnonzero(~filled[i])[0])) for i, l in enumerate(mine) if not filled[i].all()]
    if mapped is not None:
        payload.update({"layers": mine, "shm": {"path": mapped[1], "dtype": dtype_name(dtype), "shape": list(shape)}})
    else:
        payload.update({"layers": mine, "tensor": tensor_to_bytes(t)})
    if missing:
        payload.setdefault("error", f"positions never ran a forward pass (layer, first missing position): {missing}")
    return payload
