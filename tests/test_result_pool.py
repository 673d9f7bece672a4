"""The shared-memory result pool on its own (no engine): exact bytes through the frontend's zero-copy
view, release only when the last tensor is gone, reuse, growth ahead, trimming, and a full tmpfs."""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch

from vllm_worker import result_pool, shm
from vllm_worker.result_pool import ResultPool, np_dtype


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
        got = result_pool.view(desc, torch.bfloat16)
        assert torch.equal(got, src) and got.untyped_storage().nbytes() == desc["nbytes"]
        view_of_view = got[1:, 2]
        del got
        gc.collect()
        assert result_pool.take_released({pool.id}) == []  # a view of it is still alive
        other = _write(pool, torch.ones(4, 64))
        assert other["path"] != desc["path"] or other["offset"] >= desc["offset"] + desc["nbytes"]
        assert torch.equal(view_of_view, src[1:, 2])  # not overwritten
        del view_of_view
        gc.collect()
        released = result_pool.take_released({pool.id})
        assert released == [(desc["path"], desc["offset"])]
        assert result_pool.take_released({"another-pool"}) == []
        free_before = pool.free_bytes
        assert pool.free(released + [("/dev/shm/elsewhere", 0)]) == 1  # other pools' entries are ignored
        assert pool.free_bytes > free_before
        again = _write(pool, torch.zeros(3, 5, 64).to(torch.bfloat16))
        assert (again["path"], again["offset"]) == (desc["path"], desc["offset"])  # reused, no new segment
        assert pool.status()["segments_made"] == 1 and pool.status()["sync_grows"] == 1
        result_pool.discard(again)
        result_pool.discard(other)
        pool.free(result_pool.take_released({pool.id}))
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
        assert not [f for f in os.listdir(shm.SHM_DIR) if pool.id in f]
    finally:
        pool.close()
    with pytest.raises(ValueError, match="not a result-pool file"):
        result_pool.view({"path": str(tmp_path / "x-pool1-1"), "offset": 0, "size": 4096, "nbytes": 4,
                          "shape": [1]}, torch.float32)
    monkeypatch.setenv("VLLM_LENS_SHM", "0")
    assert shm.host_id() is None
