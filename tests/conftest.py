"""Session-wide fixtures for every test folder. The folder a test lives in is its group: scripts/test.sh
runs unit + core + engine, core again in compiled mode, parallel, and http + inspect, each group in a
pytest process of its own (their engines would not fit in memory together); `-m <folder>` selects one.

Engines are real in-process vLLM engines on CPU (`support.engines`); the numeric reference is HF
transformers on the same weights in float32 (`support.reference`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support import GROUPS
from support.browser import browser  # noqa: F401  (headless Chromium, one per module)
from support.engines import make_engine, shutdown_all  # sets the environment the engines need (before vLLM is imported)
from support.oracle import tiny_oracle  # noqa: F401  (a tiny activation oracle, session-wide)
from support.servers import _stop_servers, locked_server, lora_server, server  # noqa: F401  (HTTP, session-wide)
from support.threads import resizable_pool  # noqa: F401  (torch's pool resizable where vLLM replaced it)


def pytest_configure(config):
    for g in GROUPS:
        config.addinivalue_line("markers", f"{g}: tests under tests/{g}/ (marked from the folder)")
    config.addinivalue_line("markers", "run_first: runs before every other test of its pytest process")


def pytest_collection_modifyitems(config, items):
    for item in items:
        group = Path(str(item.path)).parent.name
        if group in GROUPS:
            item.add_marker(getattr(pytest.mark, group))
    # `run_first` modules (tests/core/test_compiled.py: a plugin-free engine must compile into the cache
    # before the session's engines start) go ahead of the rest of their process
    items.sort(key=lambda item: item.get_closest_marker("run_first") is None)


@pytest.fixture(scope="session", autouse=True)
def _shutdown_engines():
    """Engines end with the session, not at interpreter exit (`support.engines.shutdown_all`)."""
    yield
    shutdown_all()


@pytest.fixture(scope="session")
def engine_factory():
    return make_engine


@pytest.fixture(scope="session")
def llama():
    return make_engine("llama")


@pytest.fixture(scope="session")
def hf_factory():
    from support import reference

    return reference.hf_model
