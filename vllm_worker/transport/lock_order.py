"""The order in which the capture path's locks are taken, written down and (at debug time) asserted: the
capture store's lock, then early assembly's condition, then the result pool's lock — never the other way.
A thread that took them the other way could deadlock with the step thread."""

from __future__ import annotations

import threading
from typing import Any

# Debug-time check (set by tests; off in production: a thread-local list per lock taken).
CHECK = False


class LockOrder:
    """Ranks of the locks of early assembly (store 1, cv 2, pool 3): with `CHECK` set, taking a
    lock of a rank not above every lock this thread holds raises (a deadlock waiting to happen)."""

    STORE, CV, POOL = 1, 2, 3
    _held = threading.local()

    @classmethod
    def taking(cls, rank: int) -> None:
        if not CHECK:
            return
        stack = cls._held.__dict__.setdefault("ranks", [])
        if stack and stack[-1] >= rank:
            raise AssertionError(f"lock order: rank {rank} taken while holding rank {stack[-1]} (store -> cv -> pool)")
        stack.append(rank)

    @classmethod
    def released(cls, rank: int) -> None:
        if CHECK:
            stack = cls._held.__dict__.get("ranks")
            if stack and stack[-1] == rank:
                stack.pop()


class Ordered:
    """A lock (or condition) that reports its rank to `LockOrder` as it is taken and released."""

    def __init__(self, lock: Any, rank: int) -> None:
        self.lock, self.rank = lock, rank

    def __enter__(self) -> Any:
        LockOrder.taking(self.rank)
        try:
            return self.lock.__enter__()
        except BaseException:
            LockOrder.released(self.rank)
            raise

    def __exit__(self, *exc: Any) -> None:
        self.lock.__exit__(*exc)
        LockOrder.released(self.rank)

    def __getattr__(self, name: str) -> Any:  # wait / notify_all of a condition
        return getattr(self.lock, name)
