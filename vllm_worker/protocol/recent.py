"""Bounded memos of recent contents (a plain dict in use order): what admission remembers across requests
that send the same steering — converted vectors, digests, chain layouts and rows — so that a batch of
equal requests pays once, and memory stays bounded whatever clients send."""

from __future__ import annotations

from typing import Any, Hashable


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
