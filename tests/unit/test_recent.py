"""`protocol.recent`: the bounded memos, and `by_bytes`, the one memo by exact content that admission
(digests, action weights) and the frontend build on: only equal bytes ever share a value."""

from __future__ import annotations

import pytest

from vllm_worker.protocol.recent import EDGE, by_bytes, recall, remember, same_bytes


def test_recall_and_remember_keep_the_most_recent():
    memo: dict = {}
    for k in range(5):
        remember(memo, k, str(k), 3)
    assert list(memo) == [2, 3, 4]
    assert recall(memo, 2) == "2" and list(memo) == [3, 4, 2]  # (recalled: now the most recent)
    remember(memo, 9, "9", 0)
    assert 9 not in memo  # (kept = 0: nothing kept)


def test_by_bytes_shares_only_equal_bytes():
    memo: dict = {}
    made: list[bytes] = []

    def make(raw: bytes):
        return lambda: made.append(raw) or len(made)

    a = bytes(range(256)) * 8
    b = bytearray(a)
    b[len(b) // 2] ^= 1  # same edges, one byte differs in the middle
    b = bytes(b)
    assert a[:EDGE] == b[:EDGE] and a[-EDGE:] == b[-EDGE:]
    assert by_bytes(memo, "t", a, make(a), 4) == 1
    assert by_bytes(memo, "t", bytes(a), make(a), 4) == 1  # equal bytes, another object: shared
    assert by_bytes(memo, "t", b, make(b), 4) == 2  # equal edges only: made afresh
    assert by_bytes(memo, "u", b, make(b), 4) == 3  # another tag: made afresh
    assert len(made) == 3


def test_by_bytes_keeps_a_copy_of_a_view_and_nothing_when_make_fails():
    memo: dict = {}
    buf = bytearray(b"x" * 300)
    view = memoryview(buf)
    assert by_bytes(memo, None, view, lambda: "v", 4) == "v"
    ((kept, _),) = memo.values()
    assert type(kept) is bytes and kept == bytes(buf)
    buf[0] = ord("y")  # the caller's buffer changes: the memo's copy does not, and no longer matches
    assert by_bytes(memo, None, memoryview(buf), lambda: "w", 4) == "w"

    def fail():
        raise ValueError("bad")

    with pytest.raises(ValueError):
        by_bytes(memo, "f", b"z" * 200, fail, 4)
    assert all(k[0] != "f" for k in memo)


def test_same_bytes_is_exact_for_bytes_and_views():
    assert same_bytes(b"abc", memoryview(b"abc")) and same_bytes(b"abc", b"abc")
    assert not same_bytes(b"abc", memoryview(b"abd")) and not same_bytes(b"abc", b"ab")
