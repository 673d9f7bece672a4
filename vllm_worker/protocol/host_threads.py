"""Per-request tensor work on the host in one thread.

A request's vectors are small (at most a few MB): torch splits their copies and reductions over its intra-op
thread pool, and on a host whose cores are busy (the engine core spinning beside the frontend, other
workers) waking that pool costs far more than the work itself (docs/decisions.md, "Frontend steering cost").
The results do not depend on it: a copy is a copy, and row-wise reductions run each row in one thread.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import BuiltinFunctionType
from typing import Iterator

import torch

_OPENMP = "parallel backend: OpenMP" in torch.__config__.parallel_info()


@contextmanager
def one_thread(enabled: bool = True) -> Iterator[None]:
    """torch's intra-op pool limited to this thread while the block runs (restored after, even on error;
    `enabled` False: as it is). OpenMP builds only: torch's native pool cannot be resized once used (it
    warns and keeps its size)."""
    n = torch.get_num_threads()
    # vLLM's CPU worker replaces `torch.set_num_threads` in its process (its threads are bound to cores):
    # an in-process CPU engine keeps its pool as vLLM set it
    if not enabled or n == 1 or not _OPENMP or not isinstance(torch.set_num_threads, BuiltinFunctionType):
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
