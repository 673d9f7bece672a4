"""The prefix check every shipped eval's sample order passes (Inspect's `--limit N` takes the first N)."""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Sequence


def assert_balanced_prefixes(keys: Sequence[Hashable], what: str) -> None:
    """Every prefix of length >= the number of classes holds every class, and in every prefix the counts of
    the classes not yet used up differ by at most one."""
    total = Counter(keys)
    k = len(total)
    assert k >= 2, f"{what}: one class only ({set(total)})"
    assert len(set(keys[:k])) == k, f"{what}: the first {k} samples are {list(keys[:k])}, not one per class"
    seen: Counter = Counter()
    for n, key in enumerate(keys, 1):
        seen[key] += 1
        left = [seen[c] for c in total if seen[c] < total[c]]  # classes with samples still to come
        if left:  # no class is more than one ahead of a class that could have kept up
            assert max(seen[c] for c in total) - min(left) <= 1, (
                f"{what}: prefix of {n} is unbalanced: {dict(seen)} (of {dict(total)})"
            )
