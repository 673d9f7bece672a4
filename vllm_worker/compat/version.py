"""Which vLLM the plugin supports, and the two primitives every other compat module is built on: `require`
(an attribute vLLM must have, or a `LensIncompatibleVLLM` naming it) and `wrap` (replace a method once,
idempotently across repeated plugin loads)."""

from __future__ import annotations

import functools
import logging
import re
from typing import Any, Callable

from vllm_worker import envs

logger = logging.getLogger("vllm_worker")


# Every vLLM minor release a test run covered, and where: "cpu" (scripts/compat-matrix.sh's subset, or the
# whole suite on the release scripts/setup.sh pins), "gpu" (the H200 checks and tables in bench/results),
# or both. docs/compatibility.md gives each row's date and commit. SUPPORTED, the start-up refusal and
# pyproject's `cuda` extra (tests/unit/test_vllm_version.py holds them equal) all follow this table.
TESTED: dict[tuple[int, int], str] = {
    (0, 26): "cpu+gpu",
    (0, 27): "cpu",
    (0, 28): "cpu",
    (0, 29): "cpu",
    (0, 30): "cpu",
    (0, 31): "cpu",
    (0, 32): "cpu",
    (0, 33): "gpu",
}
# Releases on which the H200 check (bench/probes/gpu_direct_check.py) found the GPU's direct writes into the
# result pool byte-equal to host copies. Elsewhere they are off unless VLLM_LENS_DIRECT_POOL is set: on 0.33
# the check found the bytes different and the cause is not known yet (docs/decisions.md).
DIRECT_WRITES_VERIFIED: frozenset[tuple[int, int]] = frozenset({(0, 26)})
SUPPORTED = (min(TESTED), (max(TESTED)[0], max(TESTED)[1] + 1))  # [min, max) on (major, minor)
ALLOW_UNTESTED = "VLLM_LENS_ALLOW_UNTESTED_VLLM"


class LensIncompatibleVLLM(RuntimeError):
    """The installed vLLM lacks an internal the plugin needs, or is a release no test ran on."""


def vllm_version() -> tuple[int, int]:
    import vllm

    vt = getattr(vllm, "__version_tuple__", None)
    if vt and isinstance(vt[0], int) and isinstance(vt[1], int):
        return int(vt[0]), int(vt[1])
    m = re.match(r"(\d+)\.(\d+)", getattr(vllm, "__version__", ""))
    if not m:
        raise LensIncompatibleVLLM(f"cannot read the vLLM version ({getattr(vllm, '__version__', None)!r})")
    return int(m.group(1)), int(m.group(2))


def _name(v: tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


def untested_reason(v: tuple[int, int], on_gpu: bool) -> str | None:
    """Why release `v` is outside what was tested (None: it was tested, on the kind of device in use)."""
    newest = max(TESTED)
    if v not in TESTED:
        return (
            f"inspect-lens supports vLLM {_name(min(TESTED))} to {_name(newest)}, the releases it was tested with "
            f"(newest tested: {_name(newest)}; docs/compatibility.md); found vLLM {_name(v)}. Install vLLM "
            f"{_name(newest)}, or set "
            f"{ALLOW_UNTESTED}=1 to start anyway (every internal the plugin touches is still checked and a "
            "moved one is still an error), or VLLM_LENS_DISABLE=1 to run without the plugin."
        )
    if on_gpu and "gpu" not in TESTED[v]:
        gpu = ", ".join(_name(t) for t, where in sorted(TESTED.items()) if "gpu" in where)
        return (
            f"vLLM {_name(v)} was tested on CPU only; the GPU paths (graph taps, cut CUDA graphs, the V2 runner) "
            f"ran on vLLM {gpu} (docs/compatibility.md)."
        )
    if not on_gpu and "cpu" not in TESTED[v]:
        return f"vLLM {_name(v)} was tested on GPU only; the CPU suite ran on other releases (docs/compatibility.md)."
    return None


def _on_gpu() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(require(current_platform, "is_cuda", "vllm.platforms.current_platform")())


def check_version() -> tuple[int, int]:
    """Refuse a vLLM release no test ran on (a warning with VLLM_LENS_ALLOW_UNTESTED_VLLM=1): its internals
    may have moved in ways `require` cannot see (same name, new meaning)."""
    v = vllm_version()
    reason = untested_reason(v, _on_gpu() if v in TESTED and TESTED[v] != "cpu+gpu" else False)
    if reason is None:
        return v
    if v not in TESTED and not envs.get(ALLOW_UNTESTED):
        raise LensIncompatibleVLLM(reason)
    if v not in TESTED:
        reason = f"{ALLOW_UNTESTED}=1: starting on an untested vLLM. {reason}"
    _warn_once(reason)
    return v


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning("inspect-lens: %s", message)


def require(obj: Any, attr: str, where: str) -> Any:
    if not hasattr(obj, attr):
        raise LensIncompatibleVLLM(f"vLLM internal moved: {where}.{attr} not found (vLLM {vllm_version()})")
    return getattr(obj, attr)


def wrap(cls: type, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace `cls.name` by `make(original)` once (idempotent across repeated plugin loads)."""
    orig = require(cls, name, cls.__qualname__)
    if getattr(orig, "__lens_wrapped__", False):
        return
    new = make(orig)
    functools.update_wrapper(new, orig)
    new.__lens_wrapped__ = True  # type: ignore[attr-defined]  # a marker on a function object
    setattr(cls, name, new)


def then(hook: Callable[[Any], None]) -> Callable[[Callable], Callable]:
    """A `wrap` maker: the original method, then `hook(self)` (e.g. after a runner loaded its model)."""

    def make(orig: Callable) -> Callable:
        def method(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            hook(self)
            return out

        return method

    return make


def direct_writes_on() -> bool:
    """Whether a CUDA worker writes captured rows straight into the result pool: as `VLLM_LENS_DIRECT_POOL`
    says when the environment sets it, else only on a release in DIRECT_WRITES_VERIFIED (host copies serve
    the same results everywhere, only slower)."""
    given = envs.given("VLLM_LENS_DIRECT_POOL")
    if given is not None:
        return bool(given)
    v = vllm_version()
    if v not in DIRECT_WRITES_VERIFIED:
        logger.info(
            "direct result-pool writes off on vLLM %s (not verified there; VLLM_LENS_DIRECT_POOL=1 turns them on)",
            _name(v),
        )
        return False
    return True
