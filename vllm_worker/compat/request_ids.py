"""How vLLM names requests: the caller's id, vLLM's internal `-<8 hex>` suffix, the `<i>_` prefix of
sample i of n > 1, and the engine id behind one prompt of an OpenAI response."""

from __future__ import annotations

import re

from vllm_worker.compat.version import LensIncompatibleVLLM


def server_request_id(response_id: str, kind: str, prompt_index: int) -> str:
    """Engine request id behind one prompt of an OpenAI response: completions use
    `f"{response_id}-{i}"` per prompt; chat uses the response id (one prompt)."""
    if kind == "chat":
        return response_id
    return f"{response_id}-{prompt_index}"


_CHILD_RE = re.compile(r"^(\d+)_")


def child_index(worker_request_id: str, n: int) -> int:
    """Sample index of a worker request: vLLM fans `n > 1` out as `f"{i}_{internal_id}"`."""
    if n <= 1:
        return 0
    m = _CHILD_RE.match(worker_request_id)
    if not m:
        raise LensIncompatibleVLLM(f"cannot read the sample index of request {worker_request_id!r} (n={n})")
    return int(m.group(1))


_SUFFIX_RE = re.compile(r"-[0-9a-f]{8}$")


def external_request_id(worker_request_id: str, n: int) -> str:
    """The caller's request id: vLLM appends `-<8 hex>` and prefixes `<i>_` for sample i of n > 1."""
    rid = worker_request_id
    child = None
    if n > 1:
        child = child_index(rid, n)
        rid = rid.split("_", 1)[1]
    rid = _SUFFIX_RE.sub("", rid)
    return rid if child is None else f"{rid}#{child}"
