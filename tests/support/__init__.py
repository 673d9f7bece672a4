"""Helpers shared by the test folders: engines and models (`engines`, `tiny_models`), the HF reference
(`reference`), real servers (`servers`), the browser (`browser`), a tiny activation oracle (`oracle`) and
scripts run in fresh processes (`plain_run`, `plain_serve`, `user_ext`)."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
GROUPS = ("unit", "core", "engine", "parallel", "http", "inspect")


def pythonpath(*extra: str | None) -> str:
    """PYTHONPATH for processes our tests start (servers, worker processes): they import `support.*` and
    unpickle hooks defined in test modules (cloudpickle stores those by module name)."""
    parts = [str(TESTS), *(str(TESTS / g) for g in GROUPS), *extra]
    return os.pathsep.join(p for p in parts if p)
