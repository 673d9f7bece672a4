"""Bounded memos of recent contents (a plain dict in use order): what admission remembers across requests
that send the same steering — converted vectors, digests, chain layouts and rows — so that a batch of
equal requests pays once, and memory stays bounded whatever clients send."""

from __future__ import annotations

from typing import Any, Callable, Hashable, TypeVar

V = TypeVar("V")
EDGE = 64  # bytes from each end of a content in its memo key (a cheap first test before the full comparison)


def recall(memo: dict, key: Hashable) -> Any:
    """`memo[key]` (now its most recent entry), or None."""
    got = memo.pop(key, None)
    if got is not None:
        memo[key] = got
    return got


def remember(memo: dict, key: Hashable, value: Any, kept: int) -> None:
    """`value` as `memo[key]`, its most recent entry; the least recent ones dropped so that at most `kept`
    stay (0: nothing is kept)."""
    memo.pop(key, None)
    while memo and len(memo) >= kept:
        memo.pop(next(iter(memo)))
    if kept > 0:
        memo[key] = value


def same_bytes(kept: bytes, raw: bytes | memoryview) -> bool:
    """Exact byte equality, a memcmp for any buffer (`bytes.startswith` takes one; `memoryview.__eq__`
    unpacks item by item, ~80x slower at 512 KB)."""
    return len(kept) == len(raw) and (kept == raw if isinstance(raw, bytes) else kept.startswith(raw))


def by_bytes(memo: dict, tag: Hashable, raw: bytes | memoryview, make: Callable[[], V], kept: int) -> V:
    """`make()` for the content `raw` (and `tag`: whatever else the value depends on), remembered: a later
    call with equal bytes gets the same value. Keyed by `tag` and the content's edges, then compared byte for
    byte (never a hash alone), so only equal bytes ever share; the memo keeps its own copy of a view's bytes
    (a view would pin its buffer). A `make` that raises remembers nothing."""
    key = (tag, bytes(raw[:EDGE]), bytes(raw[-EDGE:]))
    got = recall(memo, key)
    if got is not None and same_bytes(got[0], raw):
        return got[1]
    value = make()
    remember(memo, key, (raw if isinstance(raw, bytes) else bytes(raw), value), kept)
    return value
