"""A steering entry's rows as the workers get them (float32 on the host, checked finite, unit rows for
ablate / cap), with their wire bytes and content digest, remembered by the exact bytes the caller sent.

Workloads that steer every request with the same vector (each request a fresh tensor, or one registered
name) made the frontend copy, check, normalise, serialise and SHA-256 the same 512 KB again per request;
a request whose bytes equal a remembered input's now only pays the comparison (and a copy of the rows it
keeps). Exact: the key's test is a byte-for-byte comparison with a copy of the earlier input (never the
caller's object, which the caller may change), so no input can take another content's rows. Only
successes are remembered; a failing input is checked, and named in its error, every time. Bounded:
`KEPT` contents, each at most `MAX_BYTES`."""

from __future__ import annotations

import hashlib
import threading
from typing import NamedTuple

import numpy as np
import torch

from vllm_worker.protocol import ops as intervention
from vllm_worker.protocol.checks import all_finite, host_float32
from vllm_worker.protocol.recent import recall, remember, same_bytes

KEPT = 8  # distinct inputs remembered ...
MAX_BYTES = 16 << 20  # ... each at most this large
MIN_BYTES = 4096  # below this the passes are as cheap as the lookup
_EDGE = 64  # bytes from each end in the key (a cheap first test before the full comparison)


class Rows(NamedTuple):
    rows: torch.Tensor  # float32: this request's own copy (rows all equal: its own first row, expanded)
    raw: bytes  # what `spec.encode` sends (shared, immutable): `rows`' bytes, or its first row's when `repeat`
    digest: bytes  # SHA-256 of all of `rows`' bytes, whatever the form (what `spec.cache_salt` hashes)
    repeat: int = 0  # > 0: every row along dim 0 is byte for byte the first; `raw` is that row, this many times


# (unit rows?, dtype, shape, edges) -> (input bytes, the rows' shape, wire bytes, digest, repeat): no tensor kept
_memo: dict[tuple, tuple[bytes, tuple[int, ...], bytes, bytes, int]] = {}
_lock = threading.Lock()  # (AsyncLLM and the HTTP server may admit from more than one thread)


def checked_rows(acts: torch.Tensor, op: str, f: str) -> Rows:
    """`acts` (already shape-checked) as the rows a worker receives; a ValueError naming `f` for NaN / inf
    or a zero direction. Bit-identical to the passes it replaces (`host_float32`, `all_finite`,
    `check_directions` and a division in place)."""
    unit = op in ("ablate", "cap")
    got_src = _input_bytes(acts)
    if got_src is None:
        return _make(acts, op, f)
    repeated, src = got_src
    key = (unit, acts.dtype, tuple(acts.shape), repeated, src[:_EDGE].tobytes(), src[-_EDGE:].tobytes())
    with _lock:
        got = recall(_memo, key)
    if got is not None and same_bytes(got[0], src.data):  # (one memcmp: exact bytes)
        _, shape, raw, digest, repeat = got
        if repeat:  # (the request's own row, read-only expanded: no dense copy of equal rows)
            row = torch.from_numpy(np.frombuffer(raw, dtype=np.float32).reshape(shape[1:]).copy())
            return Rows(row.unsqueeze(0).expand(shape), raw, digest, repeat)
        rows = torch.from_numpy(np.frombuffer(raw, dtype=np.float32).reshape(shape).copy())
        return Rows(rows, raw, digest)
    done = _make(acts, op, f)
    with _lock:
        remember(_memo, key, (src.tobytes(), tuple(done.rows.shape), done.raw, done.digest, done.repeat), KEPT)
    return done


def _make(acts: torch.Tensor, op: str, f: str) -> Rows:
    rows = host_float32(acts)
    if not all_finite(rows):
        raise ValueError(f"{f}.activations: contains NaN or inf")
    norms = intervention.check_directions(op, rows, f)
    if norms is not None:
        rows.div_(norms)  # (`rows`: host_float32's copy, ours to write; one pass, no second norm)
    raw = rows.numpy().tobytes()
    digest = hashlib.sha256(raw).digest()
    repeat = _repeats(raw, rows.shape)
    return Rows(rows, raw[: len(raw) // repeat], digest, repeat) if repeat else Rows(rows, raw, digest)


def _repeats(raw: bytes, shape: torch.Size) -> int:
    """shape[0] when every row of `raw` along dim 0 equals the first byte for byte (one memcmp a row: a
    vector applied at several layers then crosses the IPC once), else 0. Decided on the rows as sent (after
    any normalising), so the repeated form is exactly the dense one."""
    if len(shape) < 2 or shape[0] < 2 or not raw:
        return 0
    n = len(raw) // shape[0]
    first = raw[:n]
    return shape[0] if all(raw.startswith(first, i * n) for i in range(1, shape[0])) else 0


def _input_bytes(acts: torch.Tensor) -> tuple[bool, np.ndarray] | None:
    """The bytes that decide the caller's tensor as a uint8 view (a copy only of a strided one), or None where
    the memo does not apply (not a float32 / float64 host tensor, or outside the sizes kept). A tensor whose
    first dimension has stride 0 (a registered vector expanded over its layers) is all copies of its first
    row: (True, that row's bytes) — its content exactly, without a dense copy of every row to compare."""
    t = acts.detach()
    if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.float64):
        return None
    if not MIN_BYTES <= t.numel() * t.element_size() <= MAX_BYTES:
        return None
    if t.ndim >= 2 and t.shape[0] > 1 and t.stride(0) == 0:
        return True, t[0].contiguous().numpy().reshape(-1).view(np.uint8)
    return False, t.contiguous().numpy().reshape(-1).view(np.uint8)
