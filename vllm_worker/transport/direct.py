"""Direct copies: a step's captured rows written by the GPU straight into their result regions
(`VLLM_LENS_DIRECT_COPY`, with early assembly).

Why: with early assembly a host thread copies every captured row from the step arenas (pinned memory the
device->host copy lands in) into the result pool. For an all-layer capture that is the whole result (10.5
GB for 256 requests x 158 positions x 32 layers of an 8B model) copied by the host *while the step loop
runs*, and the step loop is host-bound at that batch size: the copies slowed vLLM's own host code by about
as much as they took (bench/results/2026-12-02-h200.md). Here the pool's shared-memory segments are
registered with CUDA (page-locked, mapped into the device's address space), and once every capture of a
batch has its region the step scatters its staged rows into the regions from the device (one index copy
per segment, on the side stream after the step's kernels): the host copies nothing.

- **What stays**: the arena copy still happens (a request the direct path does not serve — no region yet,
  a position out of range, a failure — is copied by the thread or assembled at fetch from the arenas as
  before), and the thread still marks which rows were written; a fetch waits for every filed step's copies
  (their event is recorded after the scatter), so no write lands in a region once it is handed out, and a
  region given back early (a dropped request) is freed only after the side stream drained.
- **Off by itself** when the mapping is refused or does not read back what the GPU wrote (checked once per
  process on a page of our own): logged, and the thread copies as before. On CPU the "device view" is the
  segment itself, so the same path runs in the tests.
"""

from __future__ import annotations

import logging
import mmap
import threading
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("vllm_worker")


def enabled(device: torch.device) -> bool:
    from vllm_worker.envs import get

    v = str(get("VLLM_LENS_DIRECT_COPY")).strip().lower()
    if v in ("0", "false", "off", "no"):
        return False
    if v in ("1", "true", "on", "yes"):
        return True
    if v != "auto":
        raise ValueError(f"VLLM_LENS_DIRECT_COPY must be auto, 1 or 0, not {v!r}")
    return device.type == "cuda"


class _Iface:
    """A `__cuda_array_interface__` over memory the device can address (a registered host range)."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 3}


def _register(ptr: int, nbytes: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed ({int(err)})")


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _device_view(ptr: int, shape: tuple[int, ...], np_dtype: np.dtype, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over registered host memory: with unified addressing the host address is the device's."""
    return torch.as_tensor(_Iface(ptr, shape, np.dtype(np_dtype).str), device=device)


def _self_test(device: torch.device) -> None:
    """The GPU writes into a registered page of ours and the host must read it back."""
    mm = mmap.mmap(-1, mmap.PAGESIZE)
    buf = np.frombuffer(mm, dtype=np.int32)
    ptr = buf.ctypes.data
    _register(ptr, mmap.PAGESIZE)
    try:
        view = _device_view(ptr, buf.shape, buf.dtype, device)
        want = torch.arange(buf.shape[0], dtype=torch.int32, device=device) * 7 + 3
        view.index_copy_(0, torch.arange(buf.shape[0], device=device), want)  # a kernel, as the steps write
        torch.cuda.synchronize(device)
        if not np.array_equal(buf, want.cpu().numpy()):
            raise RuntimeError("the host does not read what the GPU wrote through the mapping")
    finally:
        del buf
        _unregister(ptr)
        try:
            mm.close()
        except BufferError:
            pass


def words(t: torch.Tensor) -> torch.Tensor:
    """Rows of `t` as int64 words when each row is a whole number of them (a bitwise view), else `t`."""
    row = t.shape[-1] * t.element_size()
    return t.view(torch.int64) if row % 8 == 0 and t.element_size() < 8 else t


class DirectRows:
    """The result pool's segments as device tensors of rows, one per (segment, dtype, d). Made by the
    early-assembly thread before it publishes a region (never in a step); looked up by the step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.broken: str | None = None
        self._lock = threading.Lock()
        self._views: dict[tuple, torch.Tensor] = {}
        self._registered: dict[str, int] = {}  # segment path -> its registered address
        self._tested = not self.cuda

    def get(self, path: str, dtype: torch.dtype, d: int) -> torch.Tensor | None:
        return None if self.broken else self._views.get((path, dtype, d))

    def prepare(self, pool: Any, path: str, dtype: torch.dtype, d: int) -> torch.Tensor | None:
        """The segment's device view (registering the segment once); None when the path is off. Rows of
        `d` values of `dtype`, seen as 8-byte words when a row is a whole number of them (`words`): an
        index copy then moves 8 bytes per element, not 2 (wider writes over the host link)."""
        key = (path, dtype, d)
        got = self._views.get(key)
        if got is not None or self.broken:
            return got
        try:
            rows = pool.rows(path, dtype, d)
            if not self.cuda:
                t = torch.from_numpy(rows)
            else:
                with self._lock:
                    if not self._tested:
                        _self_test(self.device)
                        self._tested = True
                    if path not in self._registered:
                        ptr, size = pool.span(path)
                        _register(ptr, size)
                        self._registered[path] = ptr
                t = _device_view(rows.ctypes.data, rows.shape, rows.dtype, self.device)
            t = words(t.view(dtype) if t.dtype != dtype else t)
        except Exception as e:  # noqa: BLE001 - the thread copies instead, for the worker's life
            self.broken = f"{type(e).__name__}: {e}"
            logger.warning("inspect-lens: direct copies into result memory are off (%s)", self.broken)
            return None
        with self._lock:
            self._views[key] = t
        return t

    def forget(self, path: str) -> None:
        """The pool closes this segment (no region of it in use): its views go, and its registration."""
        with self._lock:
            for k in [k for k in self._views if k[0] == path]:
                del self._views[k]
            ptr = self._registered.pop(path, None)
        if ptr is not None:
            try:
                _unregister(ptr)
            except Exception as e:  # noqa: BLE001 - the segment is going anyway
                logger.warning("inspect-lens: cudaHostUnregister of a result segment failed (%s)", e)
