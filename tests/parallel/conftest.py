"""The TP=2 and PP=2 engines the parallel tests share (one each per session: engine start is the cost)."""

from __future__ import annotations

import pytest

from support.engines import parallel_engine


@pytest.fixture(scope="session")
def tp2():
    return parallel_engine("llama", tensor_parallel_size=2)


@pytest.fixture(scope="session")
def pp2():
    return parallel_engine("llama", pipeline_parallel_size=2)
