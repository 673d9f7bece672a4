"""Which vLLM the plugin supports, and the two primitives every other compat module is built on: `require`
(an attribute vLLM must have, or a `LensIncompatibleVLLM` naming it) and `wrap` (replace a method once,
idempotently across repeated plugin loads)."""

from __future__ import annotations

import functools
import logging
import re
from typing import Any, Callable

logger = logging.getLogger("vllm_worker")


SUPPORTED = ((0, 26), (0, 34))  # [min, max) on (major, minor)


class LensIncompatibleVLLM(RuntimeError):
    """The installed vLLM lacks an internal the plugin needs."""


def vllm_version() -> tuple[int, int]:
    import vllm

    vt = getattr(vllm, "__version_tuple__", None)
    if vt and isinstance(vt[0], int) and isinstance(vt[1], int):
        return int(vt[0]), int(vt[1])
    m = re.match(r"(\d+)\.(\d+)", getattr(vllm, "__version__", ""))
    if not m:
        raise LensIncompatibleVLLM(f"cannot read the vLLM version ({getattr(vllm, '__version__', None)!r})")
    return int(m.group(1)), int(m.group(2))


def check_version() -> tuple[int, int]:
    v = vllm_version()
    lo, hi = SUPPORTED
    if not lo <= v < hi:
        raise LensIncompatibleVLLM(
            f"inspect-lens supports vLLM {lo[0]}.{lo[1]} up to (excluding) {hi[0]}.{hi[1]}; found {v[0]}.{v[1]}. "
            "Set VLLM_LENS_DISABLE=1 to run without the plugin."
        )
    return v


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
