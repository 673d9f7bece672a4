"""Every operator-set limit in one table: its environment variable, its `vllm-lens serve` flag, its default
and what a request past it gets. The docs (docs/http.md) list the same table; `limit()` is what the code
reads, so an error message can always name the knob that produced it.

Environment variables are read when first asked for (each vLLM process inherits them from the server
process, so `vllm-lens serve --lens-max-payload-mb 8` reaches the workers too).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Limit:
    env: str
    flag: str
    default: float
    unit: str  # "MB" / "GB" (binary: MiB / GiB) or "" for a count
    what: str

    @property
    def scale(self) -> int:
        return {"MB": 1 << 20, "GB": 1 << 30, "": 1}[self.unit]


LIMITS: dict[str, Limit] = {lim.env: lim for lim in (
    Limit("VLLM_LENS_MAX_PAYLOAD_MB", "--lens-max-payload-mb", 64, "MB",
          "one structured payload (steering vectors, hooks): 400 naming the field; a request body above it "
          "+ 1 MiB: 413 while it arrives"),
    Limit("VLLM_LENS_MAX_CAPTURE_GB", "--lens-max-capture-gb", 4, "GB",
          "one request's capture at its largest (layers x (prompt + max_tokens - 1) x d_model x n, in the "
          "model's dtype): 400 naming output_residual_stream, before any compute"),
    Limit("VLLM_LENS_MAX_STORED_GB", "--lens-max-stored-gb", 8, "GB",
          "captures in flight (admitted, not yet returned) at their largest, summed over requests: 503 "
          "(offline: ValueError) for the request that would pass it, before any compute"),
    Limit("VLLM_LENS_MAX_PERSISTENT_RESULTS", "--lens-max-persistent-results", 10000, "",
          "requests whose persistent-hook results are kept until clear_hook_results: later requests fail "
          "with an error naming it"),
)}


def parse(env: str, raw: str | None) -> float:
    """A limit's setting as written (env var or flag; None/"" = its default); ValueError unless positive."""
    try:
        value = float(raw) if raw not in (None, "") else LIMITS[env].default
    except ValueError:
        raise ValueError(f"{env}: expected a number, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{env}: must be positive, got {raw!r}")
    return value


def limit(env: str) -> int:
    """The limit's value in bytes (or as a count), from the environment or its default."""
    return int(parse(env, os.environ.get(env)) * LIMITS[env].scale)


def flags() -> dict[str, str]:
    """`vllm-lens serve` flag -> environment variable."""
    return {lim.flag: lim.env for lim in LIMITS.values()}
