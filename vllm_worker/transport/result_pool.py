"""Shared-memory result memory that outlives a fetch: captures are written into regions of a few large
files that worker and frontend both keep mapped, and a region is reused once the caller is done with it.

Why: a fresh shared-memory file costs page population on both sides (several times slower to write than
memory already faulted in), plus a file open/allocate/truncate/unlink per request; a large all-layer
fetch spent most of its time there (docs/decisions.md). Memory that has been written
once is cheap to write again, so the pool keeps it:

- Worker (`ResultPool`): segments are files under /dev/shm, reserved with `posix_fallocate` (a full tmpfs
  is an ordinary error: the result then travels over RPC) and mapped with MAP_POPULATE. Requests that
  will capture announce their largest result when they arrive (`expect`); a background thread grows the
  pool to cover what is announced, so the pages are made while the GPU generates. A fetch takes
  page-aligned regions (`alloc`) and returns their (file, offset) instead of bytes.
- Frontend (`result_views.view`, another process): maps each segment once and hands out zero-copy tensors over a region. When the last
  tensor over a region is garbage-collected, the region's release is queued and travels to the worker
  with the engine's next fetch (`take_released` -> `free`).
- Bounded: free memory beyond `VLLM_LENS_SHM_POOL_GB` (default: VLLM_LENS_MAX_STORED_GB) is given back by
  dropping whole free segments (their pages are punched out first, so the frontend's stale mapping holds
  no memory), and all of it after `VLLM_LENS_SHM_POOL_IDLE_S` seconds without a fetch. A region a caller
  still holds is never touched.
"""

from __future__ import annotations

import atexit
import bisect
import logging
import mmap
import os
import threading
import time
import uuid
from typing import Any

import numpy as np
import torch

from vllm_worker.envs import get, limit
from vllm_worker.transport import shm
from vllm_worker.transport.lock_order import LockOrder, Ordered
from vllm_worker.transport.shm import POOL_TAG

logger = logging.getLogger("vllm_worker")

PAGE = mmap.PAGESIZE
MIN_SEGMENT = 16 << 20
MAX_SEGMENT = 4 << 30


def keep_bytes() -> int:
    return limit("VLLM_LENS_SHM_POOL_GB")


def idle_seconds() -> float:
    return float(get("VLLM_LENS_SHM_POOL_IDLE_S"))


def enabled() -> bool:
    return bool(get("VLLM_LENS_SHM_POOL"))


def _round(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


_np_dtypes: dict[torch.dtype, np.dtype] = {}


def np_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy type regions are written as (16-bit floats as int16: same bytes)."""
    got = _np_dtypes.get(dtype)
    if got is None:
        if dtype in (torch.bfloat16, torch.float16):
            got = np.dtype(np.int16)
        else:
            got = torch.empty((), dtype=dtype).numpy().dtype
        _np_dtypes[dtype] = got
    return got


def host_array(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor as regions are written (16-bit floats as int16: same bytes): numpy copies
    release the GIL."""
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.numpy()


class _Segment:
    __slots__ = ("path", "size", "mm", "buf", "free", "used", "serial", "addr", "unpin")

    def __init__(self, path: str, size: int, mm: mmap.mmap) -> None:
        self.path, self.size, self.mm = path, size, mm
        self.buf = np.frombuffer(mm, dtype=np.uint8)
        self.addr = int(self.buf.ctypes.data)
        self.unpin: Any = None  # set when the segment is registered with the GPU (`ResultPool(pin=...)`)
        self.free: list[list[int]] = [[0, size]]  # sorted [offset, length]
        self.used: dict[int, int] = {}  # offset -> length
        self.serial: dict[int, int] = {}  # offset -> which allocation of the pool holds it (`ResultPool.free`)

    def take(self, n: int, align: int = PAGE) -> int | None:
        """First fit of `n` bytes starting at a multiple of `align` (what is skipped stays free)."""
        for i, (off, length) in enumerate(self.free):
            start = -(-off // align) * align
            if start + n <= off + length:
                rest = [[start + n, off + length - start - n]] if off + length > start + n else []
                self.free[i : i + 1] = ([[off, start - off]] if start > off else []) + rest
                self.used[start] = n
                return start
        return None

    def give(self, off: int) -> int:
        n = self.used.pop(off)
        self.serial.pop(off, None)
        self._free_range(off, n)
        return n

    def shrink(self, off: int, n: int) -> int:
        """Keep the first `n` bytes of the region at `off`; returns the bytes given back."""
        old = self.used[off]
        if n >= old:
            return 0
        self.used[off] = n
        self._free_range(off + n, old - n)
        return old - n

    def _free_range(self, off: int, n: int) -> None:
        i = bisect.bisect_left(self.free, [off, 0])
        self.free.insert(i, [off, n])
        if i + 1 < len(self.free) and self.free[i][0] + self.free[i][1] == self.free[i + 1][0]:
            self.free[i][1] += self.free.pop(i + 1)[1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == self.free[i][0]:
            self.free[i - 1][1] += self.free.pop(i)[1]

    def unpinned(self) -> None:
        """No longer registered with the GPU (before its pages are punched out or unmapped)."""
        if self.unpin is not None:
            unpin, self.unpin = self.unpin, None
            try:
                unpin(self.addr)
            except Exception as e:  # noqa: BLE001 - the pages stay locked until the process ends
                logger.warning("inspect-lens: could not unregister a result-pool segment: %s", e)

    def close(self) -> None:
        """Give the pages back and remove the file. Only called when no region is in use; punching the
        pages out first frees them even while the frontend still maps the file."""
        self.unpinned()
        try:
            self.mm.madvise(mmap.MADV_REMOVE, 0, self.size)
        except (OSError, AttributeError, ValueError):
            pass
        shm.discard(self.path)
        self.buf = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:
            pass


class ResultPool:
    """One per worker process. `pin`: `(register(address, size) -> unregister or None)`: every new segment
    is registered with it (the GPU then writes regions directly, `transport.early`'s direct mode); a
    segment it refused is still used, by host copies."""

    def __init__(self, pin: Any = None) -> None:
        self.id = uuid.uuid4().hex[:12]
        self._pin = pin
        self._segments: dict[str, _Segment] = {}
        self._n = 0
        self._lock = Ordered(threading.Lock(), LockOrder.POOL)  # (last: after the store's and early's)
        # on the lock: growth finished (`alloc` waits for it), a trim asked for (`free`), the pool closed
        self._cv = threading.Condition(self._lock)  # type: ignore[arg-type]  # (acquire / release delegated)
        self._trim_wanted = False
        self.expected = 0  # bytes announced by running requests and not yet allocated
        self.free_bytes = 0
        self.size = 0
        self._growing = False
        self._last_use = time.monotonic()
        self._closed = False
        self._serial = 0
        self.stats = {
            "segments_made": 0,
            "segments_dropped": 0,
            "allocs": 0,
            "frees": 0,
            "sync_grows": 0,
            "grow_s": 0.0,
            "stale_releases": 0,
            "pin_s": 0.0,
            "pinned_segments": 0,
            "direct_allocs": 0,
        }
        threading.Thread(target=self._idle_loop, name="lens-pool-release", daemon=True).start()
        atexit.register(self.close)

    # -------------------------------------------------------------- growth

    def _new_segment(self, size: int) -> _Segment | None:
        """A segment of at least `size`; growing geometrically (at least half the pool) keeps the count
        of segments logarithmic in the pool's size."""
        size = _round(max(size, MIN_SEGMENT, min(MAX_SEGMENT, self.size // 2)), 2 << 20)
        with self._lock:
            self._n += 1
            n = self._n
        path = os.path.join(shm.shm_dir(), f"{shm.PREFIX}{os.getpid()}{POOL_TAG}{self.id}-{n}")
        t = time.perf_counter()
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except OSError as e:
            shm.discard(path)
            logger.warning(
                "inspect-lens: no room for %d MB of shared result memory in %s (%s); results travel over RPC",
                size >> 20,
                shm.shm_dir(),
                e,
            )
            return None
        finally:
            os.close(fd)
        seg = _Segment(path, size, mm)
        if self._pin is not None:  # (seconds for GBs: done here, in the growing thread, before anyone uses it)
            t_pin = time.perf_counter()
            try:
                seg.unpin = self._pin(seg.addr, size)
            except Exception as e:  # noqa: BLE001 - host copies still serve this segment
                logger.warning("inspect-lens: could not register a result-pool segment with the GPU: %s", e)
            self.stats["pin_s"] += time.perf_counter() - t_pin
            self.stats["pinned_segments"] += seg.unpin is not None
        with self._lock:
            self._segments[path] = seg
            self.size += size
            self.free_bytes += size
            self.stats["segments_made"] += 1
            self.stats["grow_s"] += time.perf_counter() - t
        return seg

    def expect(self, nbytes: int) -> int:
        """A request that will capture up to `nbytes` arrived: grow ahead, in the background, so its
        result lands in memory that is already there. Returns what was accounted (give it to `unexpect`)."""
        nbytes = _round(nbytes)
        with self._lock:
            if self._closed or nbytes > MAX_SEGMENT or self.expected + nbytes > keep_bytes():
                return 0
            self.expected += nbytes
            start = not self._growing and self.expected > self.free_bytes
            if start:
                self._growing = True
        if start:
            threading.Thread(target=self._grow, name="lens-pool-grow", daemon=True).start()
        return nbytes

    def unexpect(self, nbytes: int) -> None:
        if nbytes:
            with self._lock:
                self.expected = max(0, self.expected - nbytes)

    def _grow(self) -> None:
        try:
            while True:
                with self._lock:
                    deficit = self.expected - self.free_bytes
                    if self._closed or deficit <= 0:
                        return
                if self._new_segment(min(MAX_SEGMENT, deficit)) is None:
                    return
        finally:
            with self._cv:
                self._growing = False
                self._cv.notify_all()

    def in_use(self) -> int:
        return self.size - self.free_bytes

    # -------------------------------------------------------------- regions

    def alloc(self, nbytes: int, expected: int = 0, align: int = PAGE) -> tuple[str, int, int, np.ndarray] | None:
        """A region of at least `nbytes` starting at a multiple of `align` (and of the page size): (file,
        offset, file size, writable uint8 array), or None when shared memory has no room (the caller
        falls back to bytes over RPC)."""
        align = int(np.lcm(PAGE, align))
        need = _round(nbytes)
        for attempt in range(3):
            with self._lock:
                if expected:
                    self.expected = max(0, self.expected - expected)
                    expected = 0
                for seg in self._segments.values():
                    off = seg.take(need, align)
                    if off is not None:
                        self._serial += 1
                        seg.serial[off] = self._serial
                        self.free_bytes -= need
                        self.stats["allocs"] += 1
                        self._last_use = time.monotonic()
                        return seg.path, off, seg.size, seg.buf[off : off + nbytes]
                growing = self._growing
            if growing and attempt == 0:  # the background thread may be about to add room: wait for its word
                with self._cv:
                    while self._growing:
                        self._cv.wait()
                continue
            self.stats["sync_grows"] += 1
            if self._new_segment(need + align) is None:
                return None
        return None

    def alloc_now(self, nbytes: int, expected: int = 0, align: int = PAGE) -> tuple[str, int, int, int] | None:
        """A region from memory the pool has now, in a segment the GPU can write (with `pin`; any segment
        without): (file, offset, file size, segment address), or None. Never waits and never grows the
        pool: the step thread asks (the caller then leaves the request to host copies)."""
        align = int(np.lcm(PAGE, align))
        need = _round(nbytes)
        with self._lock:
            for seg in self._segments.values():
                if self._pin is not None and seg.unpin is None:
                    continue
                off = seg.take(need, align)
                if off is not None:
                    if expected:
                        self.expected = max(0, self.expected - expected)
                    self._serial += 1
                    seg.serial[off] = self._serial
                    self.free_bytes -= need
                    self.stats["allocs"] += 1
                    self.stats["direct_allocs"] += 1
                    self._last_use = time.monotonic()
                    return seg.path, off, seg.size, seg.addr
        return None

    def address(self, path: str) -> int:
        """Where segment `path` is mapped, if the GPU can write it (with `pin`: registered), else 0."""
        with self._lock:
            seg = self._segments.get(path)
            if seg is None or (self._pin is not None and seg.unpin is None):
                return 0
            return seg.addr

    def rows(self, path: str, dtype: torch.dtype, d: int) -> np.ndarray:
        """Segment `path` as a (rows, d) array of `np_dtype(dtype)`: regions aligned to a row are row ranges."""
        seg = self._segments[path]
        nd = np_dtype(dtype)
        n = seg.size // (d * nd.itemsize)
        return seg.buf[: n * d * nd.itemsize].view(nd).reshape(n, d)

    def shrink(self, path: str, off: int, nbytes: int) -> None:
        """A region's result turned out smaller than taken: its tail (whole pages) goes back."""
        with self._lock:
            seg = self._segments.get(path)
            if seg is not None and off in seg.used:
                self.free_bytes += seg.shrink(off, _round(max(1, nbytes)))

    def segment_paths(self) -> set[str]:
        with self._lock:
            return set(self._segments)

    def serial(self, path: str, off: int) -> int:
        """Which allocation holds the region at (path, off): its result's descriptor carries it, and so
        does its release, so a release that arrives twice (one payload shared by the n samples of a
        request is admitted once per sample) can never free a later allocation of the same place."""
        with self._lock:
            return self._segments[path].serial.get(off, 0)

    def free(self, released: list) -> int:
        """Regions the frontend is done with (`(path, offset[, serial])`, as they came over RPC; other
        pools' entries, and releases of an earlier allocation of the same place, are ignored). Callers hold
        the store's or the early-assembly lock, in the step thread too: segments that are no longer needed
        are dropped by the pool's own thread (`trim`: unregistering from the GPU and unmapping block in the
        driver), never here."""
        n = 0
        with self._lock:
            for entry in released:
                path, off = str(entry[0]), int(entry[1])
                seg = self._segments.get(path)
                if seg is None or off not in seg.used:
                    continue
                if len(entry) > 2 and entry[2] is not None and int(entry[2]) != seg.serial.get(off):
                    self.stats["stale_releases"] += 1
                    continue
                self.free_bytes += seg.give(off)
                n += 1
            self.stats["frees"] += n
            self._last_use = time.monotonic()
            if n:
                self._trim_wanted = True
                self._cv.notify_all()
        return n

    def trim(self, keep: int | None = None) -> None:
        """Drop whole free segments (largest first) while more than `keep` bytes are free."""
        keep = keep_bytes() if keep is None else keep
        with self._lock:
            spare = self.free_bytes - max(keep, self.expected)
            if spare <= 0:
                return
            gone = []
            for seg in sorted(self._segments.values(), key=lambda s: -s.size):
                if not seg.used and seg.size <= spare:
                    gone.append(self._segments.pop(seg.path))
                    spare -= seg.size
                    self.size -= seg.size
                    self.free_bytes -= seg.size
                    self.stats["segments_dropped"] += 1
        for seg in gone:
            seg.close()

    def _idle_loop(self) -> None:
        """The pool's own thread: trims after frees (`free`), and gives everything free back after
        `VLLM_LENS_SHM_POOL_IDLE_S` without use."""
        while True:
            with self._cv:
                if not self._trim_wanted and not self._closed:
                    self._cv.wait(min(5.0, max(0.5, idle_seconds() / 4)))
                if self._closed:
                    return
                wanted, self._trim_wanted = self._trim_wanted, False
            if wanted:
                self.trim()
            if self.free_bytes and not self.expected and time.monotonic() - self._last_use > idle_seconds():
                self.trim(keep=0)

    def close(self) -> None:
        """Engine shutdown: free segments go; segments with regions a caller still holds stay mapped by
        that caller (their files are removed, so the memory goes with the last tensor)."""
        with self._cv:
            self._closed = True
            segs = list(self._segments.values())
            self._segments.clear()
            self._cv.notify_all()
        for seg in segs:
            if seg.used:
                seg.unpinned()
                for off, length in seg.free:
                    try:
                        seg.mm.madvise(mmap.MADV_REMOVE, off, length)
                    except (OSError, AttributeError, ValueError):
                        pass
                shm.discard(seg.path)
            else:
                seg.close()

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "segments": len(self._segments),
                "bytes": self.size,
                "free_bytes": self.free_bytes,
                "regions_in_use": sum(len(s.used) for s in self._segments.values()),
                "expected_bytes": self.expected,
                **self.stats,
            }
