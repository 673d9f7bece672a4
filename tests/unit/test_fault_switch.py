"""`faults.check` runs for every request and step, so whether fault injection is asked is read from the
dict `os.environ` keeps (one key test, no Python call) and only a set value goes through `envs`: a test
setting `VLLM_LENS_INJECT_FAULT` at run time (environment or `faults.STAGE`) must still act at once, and
the premise (CPython's `os.environ._data`, keyed by `encodekey`) must fail loudly here if it moves."""

from __future__ import annotations

import os
import sys

from vllm_worker.worker import faults


def _raises(stage: str) -> bool:
    try:
        faults.check(stage)
    except faults.InjectedFault:
        return True
    return False


def test_the_environment_mapping_is_the_one_os_environ_reads(monkeypatch):
    assert faults._KEY is not None, "os.environ keeps no `_data` dict (another Python?): every check reads envs"
    monkeypatch.setenv(faults.NAME, "plan")
    assert faults._KEY in faults._DATA
    monkeypatch.delenv(faults.NAME)
    assert faults._KEY not in faults._DATA and faults.NAME not in os.environ


def test_injection_set_at_run_time_acts_at_once(monkeypatch):
    monkeypatch.delenv(faults.NAME, raising=False)
    monkeypatch.setattr(faults, "STAGE", None)
    assert not any(_raises(s) for s in faults.STAGES)
    monkeypatch.setenv(faults.NAME, "plan")
    assert _raises("plan") and not _raises("admission")
    monkeypatch.setenv(faults.NAME, "admission")  # (a changed value, not a remembered one)
    assert _raises("admission") and not _raises("plan")
    monkeypatch.setenv(faults.NAME, " ")  # blank: the setting's default (none)
    assert not _raises("admission")
    os.environ[faults.NAME] = "flush"  # (without monkeypatch: the same mapping)
    assert _raises("flush")
    del os.environ[faults.NAME]
    assert not _raises("flush")
    monkeypatch.setattr(faults, "STAGE", "fill")  # (in-process engines' switch)
    assert _raises("fill") and not _raises("flush")


def test_a_replaced_os_environ_is_read_through_envs(monkeypatch):
    monkeypatch.delenv(faults.NAME, raising=False)
    monkeypatch.setattr(os, "environ", {faults.NAME: "tap"})  # (not the mapping whose dict `faults` holds)
    assert _raises("tap")


def test_nothing_asked_costs_no_call_beyond_check(monkeypatch):
    monkeypatch.delenv(faults.NAME, raising=False)
    monkeypatch.setattr(faults, "STAGE", None)
    calls: list[str] = []

    def count(frame, event, arg):  # type: ignore[no-untyped-def]
        if event in ("call", "c_call"):
            calls.append(getattr(arg, "__name__", None) or frame.f_code.co_name)

    sys.setprofile(count)
    try:
        faults.check("admission")
    finally:
        sys.setprofile(None)
    assert calls[:1] == ["check"] and len(calls) <= 2, calls  # (check, then setprofile(None) itself)
