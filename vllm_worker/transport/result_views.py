"""Frontend side of the shared-memory result pool (`result_pool` is the worker's side, in another
process): each segment mapped once, zero-copy tensors over the regions our worker wrote, and the regions
whose last tensor is gone queued to travel back with the engine's next fetch (`take_released`)."""

from __future__ import annotations

import mmap
import os
import threading
import weakref

import numpy as np
import torch

from vllm_worker.transport import shm
from vllm_worker.transport.shm import POOL_TAG


class _Mapping:
    __slots__ = ("mm", "views")

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm, self.views = mm, 0


_maps: dict[str, _Mapping] = {}
_released: dict[str, list[tuple[str, int]]] = {}  # pool id -> regions to give back
# re-entrant: a finalizer (`_release`) can run inside any allocation, including one made while this
# thread holds the lock (garbage collection of a cycle that holds a result tensor)
_front_lock = threading.RLock()


_pool_ids: dict[str, str] = {}  # segment path -> pool id (a handful of segments, asked for every result)


def pool_id(path: str) -> str:
    """The pool a segment file belongs to (from its name)."""
    got = _pool_ids.get(path)
    if got is None:
        got = os.path.basename(path).split(POOL_TAG, 1)[1].rsplit("-", 1)[0]
        if len(_pool_ids) >= 4096:
            _pool_ids.clear()
        _pool_ids[path] = got
    return got


def _mapping(path: str, size: int) -> _Mapping:
    m = _maps.get(path)
    if m is None:
        if (
            os.path.dirname(path) != shm.shm_dir()
            or not os.path.basename(path).startswith(shm.PREFIX)
            or POOL_TAG not in os.path.basename(path)
        ):
            raise ValueError(f"inspect-lens: refusing to map {path!r} (not a result-pool file)")
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        m = _maps[path] = _Mapping(mm)
    return m


def view(desc: dict, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over a region our worker wrote (no copy). The region goes back to the worker when the
    last tensor sharing its memory is gone."""
    path, off, nbytes = desc["path"], int(desc["offset"]), int(desc["nbytes"])
    with _front_lock:
        m = _mapping(path, int(desc["size"]))
        m.views += 1
    arr = np.frombuffer(m.mm, dtype=np.uint8, count=nbytes, offset=off)
    weakref.finalize(arr, _release, path, off, desc.get("serial"))
    return torch.from_numpy(arr).view(dtype).view(list(desc["shape"]))


def _entry(path: str, off: int, serial: int | None) -> tuple:
    return (path, off) if serial is None else (path, off, serial)


def _release(path: str, off: int, serial: int | None = None) -> None:
    with _front_lock:
        _released.setdefault(pool_id(path), []).append(_entry(path, off, serial))
        m = _maps.get(path)
        if m is not None:
            m.views -= 1


def discard(desc: dict) -> None:
    """A region that will not be read: give it back with the next fetch."""
    with _front_lock:
        _released.setdefault(pool_id(desc["path"]), []).append(
            _entry(desc["path"], int(desc["offset"]), desc.get("serial"))
        )


def take_released(pools: set[str], unmap: bool = True) -> list[tuple]:
    """Regions of these pools (one engine's workers) to give back; with `unmap`, also unmaps segments
    their worker has removed once nothing here uses them (a stat per mapped segment: done with fetches
    and explicit releases, not for every new request)."""
    out: list[tuple] = []
    with _front_lock:
        for pid in pools:
            got = _released.pop(pid, None)
            if got:
                out += got
        if not unmap:
            return out
        stale = [p for p, m in _maps.items() if m.views <= 0 and not os.path.exists(p)]
        for p in stale:
            try:
                _maps.pop(p).mm.close()
            except BufferError:  # a tensor is still alive after all: keep the mapping
                pass
    return out


def pools_of(results: dict) -> set[str]:
    """Pool ids named in merged fetch results (to route later releases to the right engine)."""
    found = set()
    for per_child in results.values():
        if isinstance(per_child, dict):
            for parts in per_child.values():
                for part in parts if isinstance(parts, list) else ():
                    if isinstance(part, dict) and "pool" in part:
                        found.add(pool_id(part["pool"]["path"]))
    return found
