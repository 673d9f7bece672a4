"""Sample order for the shipped evals: classes interleaved, so that Inspect's `--limit N` (which takes the
first N samples) gets every class as soon as N reaches the number of classes, and about as many of each.

A dataset grouped by class makes `--limit` misleading: the oracle eval's first 12 texts were all "sports",
so a no-vector control that always answers "sports" scored 1.000 on `--limit 8`.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable, Sequence, TypeVar

T = TypeVar("T")


def round_robin(*groups: Sequence[T]) -> list[T]:
    """One of each group in turn (each group's own order kept); a group that runs out is skipped."""
    out: list[T] = []
    for i in range(max((len(g) for g in groups), default=0)):
        out += [g[i] for g in groups if i < len(g)]
    return out


def interleave(items: Iterable[T], key: Callable[[T], Hashable]) -> list[T]:
    """`items` grouped by `key` (groups in order of first appearance, items in their order within each
    group), then taken round-robin: every prefix of length >= the number of classes holds every class,
    and a prefix's class counts differ by at most one until a class runs out."""
    groups: dict[Hashable, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return round_robin(*groups.values())
