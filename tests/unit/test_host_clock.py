"""`host_clock`: a worker process's CPU by thread and its collections by the thread that ran them (what
`lens_rusage` reports beside the step thread's own clock)."""

from __future__ import annotations

import gc
import sys
import threading
import time

import pytest

from vllm_worker.worker import host_clock

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/task")


def _burn(seconds: float, burnt: threading.Event, release: threading.Event) -> None:
    t0 = time.thread_time()
    n = 0
    while time.thread_time() - t0 < seconds:
        n += 1
    burnt.set()
    release.wait(30)  # (alive, and in Python's list of threads, until the test has read it)


def test_each_thread_is_named_and_a_busy_one_is_charged_its_own_cpu():
    before = host_clock.threads_cpu()
    burnt, release = threading.Event(), threading.Event()
    t = threading.Thread(target=_burn, args=(0.3, burnt, release), name="lens-test-burner")
    t.start()
    try:
        assert burnt.wait(30)
        seen = host_clock.threads_cpu()
    finally:
        release.set()
        t.join()
    assert threading.current_thread().name in before  # Python's name for this thread, not its kernel name
    assert "lens-test-burner" in seen, seen
    assert 0.2 <= seen["lens-test-burner"] <= 5.0  # its own CPU (clock ticks), not the process's
    assert all(v > 0 for v in seen.values())  # (threads that used none are left out)


def test_collections_are_counted_on_the_thread_that_ran_them():
    clock = host_clock.GcClock()
    try:
        gc.collect(0)
        t = threading.Thread(target=lambda: gc.collect(), name="lens-test-collector")
        t.start()
        t.join()
        got = clock.snapshot()
    finally:
        gc.callbacks.remove(clock._on)
    mine = got[threading.current_thread().name]
    assert mine["gen0"] >= 1 and mine["gen0_s"] >= 0
    assert got["lens-test-collector"]["gen2"] >= 1
    got["lens-test-collector"]["gen2"] = -1  # a snapshot is a copy: the clock's own counts are not changed
    assert clock.snapshot()["lens-test-collector"]["gen2"] >= 1


def test_the_clock_starts_once_and_only_when_asked(monkeypatch):
    monkeypatch.setattr(host_clock, "_CLOCK", [])
    monkeypatch.delenv("VLLM_LENS_HOST_CLOCK", raising=False)
    host_clock.start()
    assert "gc" not in host_clock.report() and "threads" in host_clock.report()
    monkeypatch.setenv("VLLM_LENS_HOST_CLOCK", "1")
    host_clock.start()
    host_clock.start()
    try:
        assert len(host_clock._CLOCK) == 1
        gc.collect()
        assert host_clock.report()["gc"][threading.current_thread().name]["gen2"] >= 1
    finally:
        gc.callbacks.remove(host_clock._CLOCK[0]._on)
