"""The field checks shared by the objects callers build (`api`) and the request payload (`spec`): one rule
for a list of ints, one for a finite number and one for a tensor of finite values, each error naming the
field."""

from __future__ import annotations

import math
import re
from typing import Any


def int_list(value: Any, field: str, what: str = "entries") -> list[int]:
    """A list of ints (a tuple, range or 1-D tensor of ints is one too; bools are not ints)."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):  # a tensor / array
        value = value.tolist()
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{field}: expected a list of ints, got {type(value).__name__}")
    out = list(value)
    for x in out:
        if isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(f"{field}: {what} must be ints, got {x!r}")
    return out


def finite_number(value: Any, field: str) -> float:
    """An int or float that is finite (no bools, NaN, inf or an int too large for a float)."""
    try:
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    except OverflowError:  # an int too large for a float (e.g. 10**400 from JSON)
        ok = False
    if not ok:
        raise ValueError(f"{field}: expected a finite number, got {str(value)[:40]!r}")
    return float(value)


_VECTOR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


def vector_name(value: Any, field: str) -> str:
    """The name of a registered vector: 1-128 URL-safe characters (it is a path segment in
    `DELETE /v1/lens/vectors/{name}`)."""
    if not isinstance(value, str) or not _VECTOR_NAME.fullmatch(value):
        raise ValueError(
            f"{field}: expected 1-128 characters of letters, digits, '_', '.', ':' or '-' (starting with a "
            f"letter or digit), got {str(value)[:60]!r}"
        )
    return value


def unknown_vector(field: str, name: str, known: list[str]) -> ValueError:
    """The error for a steering entry naming a vector nobody registered (in this key's scope). Its wording
    is read back by `unknown_vectors` (a client seeing it in an HTTP 400 can upload the vector again)."""
    listed = ", ".join(repr(n) for n in known[:20]) + (", ..." if len(known) > 20 else "")
    return ValueError(
        f"{field}: unknown vector {name!r} (registered: {listed or 'none'}); register it first "
        "(POST /v1/lens/vectors, or llm.register_vector offline)"
    )


_UNKNOWN_VECTOR = re.compile(f"unknown vector '({_VECTOR_NAME.pattern})'")


def unknown_vectors(text: str) -> list[str]:
    """The names an `unknown_vector` error (anywhere in `text`) says are not registered."""
    return _UNKNOWN_VECTOR.findall(text)


def all_finite(t: Any) -> bool:
    """Whether a host tensor holds no NaN / inf. float32 / float64 are checked by numpy over the same memory:
    one pass on the calling thread, where torch's check dispatches to its intra-op thread pool (every
    request's vectors pass here, on the thread that feeds the engine)."""
    import numpy as np
    import torch

    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64):
        return bool(np.isfinite(t.detach().numpy()).all())
    return bool(torch.isfinite(t).all())


def host_float32(t: Any) -> Any:
    """A float32 copy of tensor `t` on the host, of its own memory. From a float32 / float64 host tensor numpy
    copies it on the calling thread: torch spreads a copy this size over its intra-op threads, which in a
    process beside a busy engine cost milliseconds a request (`all_finite` says why that thread matters)."""
    import numpy as np
    import torch

    t = t.detach()
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.array(t.numpy(), dtype=np.float32, order="C", copy=True))
    return torch.empty(t.shape, dtype=torch.float32).copy_(t)
