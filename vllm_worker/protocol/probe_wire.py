"""One probe's scores of one request as they travel from a worker to the frontend (a fetch's part, a
progress RPC's answer): `{"positions": <int64 bytes>, "scores": <float32 bytes, row-major>, "n_out": k}`.

Flat on purpose: a dict holding only ints and bytes is never tracked by Python's garbage collector (nor
once decoded by msgspec or pickle), so a fetch of many requests x probes adds no tracked objects for it;
`wire.tensor_to_bytes`'s form (a dict per tensor with a `shape` list) made five per probe and request,
which a frontend's next full collection walks (docs/decisions.md, tailgc).

A fetch's part may carry a request's probes as one block instead (`pack_block`): `part["probes"]` is then
`{name: n_out}` in the request's order and `part[BLOCK]` `{"positions": <int64 bytes>, "scores": <float32
bytes>}`, the probes' `(n, n_out)` scores one after another over the same positions — one item a request,
not one a probe, on both sides and over the engine's IPC (docs/decisions.md, tail6). Progress RPCs and a
lone request's fetch keep the item per probe; `items_of` reads either form."""

from __future__ import annotations

from typing import Any

import numpy as np


def pack(positions: bytes, scores: bytes, n_out: int) -> dict[str, Any]:
    """The item of `n` positions (`positions`: n int64) and their `(n, n_out)` float32 scores."""
    return {"positions": positions, "scores": scores, "n_out": n_out}


def pack_rows(positions: bytes, scores: bytes, n: int, n_out: int) -> list[dict[str, Any]]:
    """`pack` of `n` items with the same `positions` whose scores are consecutive equal-sized slices of
    `scores` (a group's one copy), in one comprehension rather than a call per item."""
    size = len(scores) // n if n else 0
    return [{"positions": positions, "scores": scores[k * size : (k + 1) * size], "n_out": n_out} for k in range(n)]


def pack_arrays(positions: np.ndarray, scores: np.ndarray) -> dict[str, Any]:
    """`pack` of a (n,) int64 and a (n, n_out) float32 array (little-endian hosts: the wire's byte order)."""
    pos = np.ascontiguousarray(positions, dtype=np.int64).tobytes() if positions.size else b""
    vals = np.ascontiguousarray(scores, dtype=np.float32).tobytes() if scores.size else b""
    return pack(pos, vals, int(scores.shape[1]))


BLOCK = "probe_block"  # a part's key holding its probes' block (`pack_block`)


def pack_block(positions: bytes, scores: bytes, names: list[str], n_out: int) -> tuple[dict[str, int], dict[str, Any]]:
    """(`part["probes"]`, `part[BLOCK]`) of a request whose probes `names` (in its order) all have `n_out`
    outputs over the same `positions`, their scores `scores` (each probe's `(n, n_out)` rows in turn)."""
    return dict.fromkeys(names, n_out), {"positions": positions, "scores": scores}


def pack_blocks(positions: bytes, scores: bytes, names: list[str], n_out: int, n: int) -> list[tuple[dict, dict]]:
    """`pack_block` of `n` requests with the same probes `names` over the same `positions`, whose blocks are
    consecutive equal-sized slices of `scores` (a group's one copy), each with its own `{name: n_out}`."""
    size = len(scores) // n if n else 0
    first = dict.fromkeys(names, n_out)
    return [(first.copy(), {"positions": positions, "scores": scores[k * size : (k + 1) * size]}) for k in range(n)]


def unpack_block(names: Any, block: Any, field: str) -> tuple[bytes, bytes, int, list[int]]:
    """(positions' bytes, scores' bytes, n, each probe's n_out) of a part's block, checked: a ValueError
    names `field`."""
    if not isinstance(names, dict) or not isinstance(block, dict):
        raise ValueError(f"{field}: expected {{name: n_out}} and {{positions, scores}}")
    ks = list(names.values())
    for name, k in names.items():
        if type(k) is not int or k < 0:
            raise ValueError(f"{field}.{name}.n_out: expected a non-negative int, got {k!r}")
    pos, vals = block.get("positions"), block.get("scores")
    if isinstance(pos, (memoryview, bytearray)):
        pos = bytes(pos)
    if isinstance(vals, (memoryview, bytearray)):
        vals = bytes(vals)
    if type(pos) is not bytes or len(pos) % 8:
        raise ValueError(f"{field}.positions: expected int64 bytes")
    n = len(pos) >> 3
    if type(vals) is not bytes or len(vals) != 4 * n * sum(ks):
        raise ValueError(f"{field}.scores: expected {n} x {sum(ks)} float32 bytes")
    return pos, vals, n, ks


def items_of(part: dict, field: str = "probe_scores") -> dict[str, dict[str, Any]]:
    """A part's probes as one item per probe (`pack`), whichever form it came in (checked as `unpack_block`)."""
    names = part.get("probes") or {}
    if BLOCK not in part:
        return dict(names)
    pos, vals, n, ks = unpack_block(names, part[BLOCK], field)
    out, at = {}, 0
    for name, k in zip(names, ks):
        out[name] = pack(pos, vals[at : at + 4 * n * k], k)
        at += 4 * n * k
    return out


def unpack(item: Any, field: str) -> tuple[bytes, bytes, int, int]:
    """(positions' bytes, scores' bytes, n, n_out) of an item, checked: a ValueError names `field`."""
    if not isinstance(item, dict):
        raise ValueError(f"{field}: expected {{positions, scores, n_out}}, got {type(item).__name__}")
    pos, vals, n_out = item.get("positions"), item.get("scores"), item.get("n_out")
    if isinstance(pos, memoryview):
        pos = pos.tobytes()
    if isinstance(vals, memoryview):
        vals = vals.tobytes()
    if not isinstance(pos, (bytes, bytearray)) or len(pos) % 8:
        raise ValueError(f"{field}.positions: expected int64 bytes")
    if type(n_out) is not int or n_out < 0:
        raise ValueError(f"{field}.n_out: expected a non-negative int, got {n_out!r}")
    n = len(pos) // 8
    if not isinstance(vals, (bytes, bytearray)) or len(vals) != 4 * n * n_out:
        raise ValueError(f"{field}.scores: expected {n} x {n_out} float32 bytes")
    return bytes(pos), bytes(vals), n, n_out


def unpack_into(items: dict, field: str, poss: list, raws: list, ns: list, ks: list) -> None:
    """`unpack` of each `{name: item}` of a part, appended to the four lists: the usual item (a dict of two
    bytes objects and an int whose sizes agree) is checked here without a call; anything else goes through
    `unpack` (the same checks, its ValueError naming `field.name`)."""
    for name, item in items.items():
        if type(item) is dict:
            pos, vals, n_out = item.get("positions"), item.get("scores"), item.get("n_out")
            if type(pos) is bytes and type(vals) is bytes and type(n_out) is int and n_out >= 0:
                n = len(pos) >> 3
                if n << 3 == len(pos) and len(vals) == 4 * n * n_out:
                    poss.append(pos)
                    raws.append(vals)
                    ns.append(n)
                    ks.append(n_out)
                    continue
        pos, vals, n, n_out = unpack(item, f"{field}.{name}")
        poss.append(pos)
        raws.append(vals)
        ns.append(n)
        ks.append(n_out)


def arrays(item: Any, field: str) -> tuple[np.ndarray, np.ndarray]:
    """(positions (n,) int64, scores (n, n_out) float32) of an item as read-only views of its bytes."""
    pos, vals, n, n_out = unpack(item, field)
    return np.frombuffer(pos, dtype=np.int64), np.frombuffer(vals, dtype=np.float32).reshape(n, n_out)
