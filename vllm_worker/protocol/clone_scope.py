"""Where a deep copy of a request's steering vectors may share their tensors instead of copying them.

vLLM deep-copies every request's `SamplingParams` in `InputProcessor.process_inputs` so it can edit its own
copy; our frontend reads that copy's vectors in the same call (copying what it keeps: `host_float32`) and
drops them from `extra_args`. Inside that call alone the copy's tensor is never written nor kept, so
cloning it is wasted work. Everywhere else (a caller's own `copy.deepcopy`) a deep copy copies.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

_local = threading.local()


@contextmanager
def sharing_tensors() -> Iterator[None]:
    """Deep copies made on this thread while the block runs may share plain tensors (restored after)."""
    before = getattr(_local, "share", False)
    _local.share = True
    try:
        yield
    finally:
        _local.share = before


def tensors_shared() -> bool:
    return getattr(_local, "share", False)
