"""torch's intra-op pool made resizable for a test, as it is in a GPU server's frontend: vLLM's in-process CPU
worker (an engine an earlier test of the process started) replaces `torch.set_num_threads` with a function
that only warns, which `host_threads.one_thread` then leaves alone."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch


@pytest.fixture()
def resizable_pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch's own `set_num_threads` for the test; the pool's size as it was after it."""
    monkeypatch.setattr(torch, "set_num_threads", torch._C.set_num_threads)
    before = torch.get_num_threads()
    yield
    torch._C.set_num_threads(before)
