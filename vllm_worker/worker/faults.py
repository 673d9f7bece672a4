"""Fault injection for tests: makes the plugin's own per-step code raise at one named stage, to prove
that such a failure fails the requests involved (with a clear error) and never the engine.

Inactive unless a test sets `STAGE` (in-process engines) or the process starts with
`VLLM_LENS_INJECT_FAULT=<stage>`. Per-step stages: admission, flush (the step's new
steering moved to the device), plan, fill, tap (the Python path), kernel
(the graph-safe kernel inside the tap op), file, assemble; probes (scoring the staged rows after a graph-safe
step: `FEATURE_STAGES`, reached only by requests asking for probe scores); actions (folding probe actions'
scores in after a step, both paths: reached only by requests with `probe_actions`); outcomes (reading the
outcomes of the actions of the requests that left). At load: layout (the decoder layers are not
found, as on a model whose layout the plugin cannot read). In the background: early (the early-assembly
thread's copy; its failure fails no request: results are then assembled at fetch).
"""

from __future__ import annotations

import os

from vllm_worker import envs

STAGES = ("admission", "flush", "plan", "fill", "tap", "kernel", "file", "assemble")
FEATURE_STAGES = ("probes", "actions", "outcomes")
AT_LOAD = ("layout",)
BACKGROUND = ("early",)
STAGE: str | None = None  # set by in-process tests; else `VLLM_LENS_INJECT_FAULT`, read when asked
NAME = "VLLM_LENS_INJECT_FAULT"
# `check` runs for every request and step: whether the environment sets NAME at all is asked of the dict
# `os.environ` keeps it in (CPython: `_data`, keys encoded; the same test `os.environ.get` makes, without its
# three Python calls), read at each call, so a change of the environment acts at once; only a set value
# (a test's) is read through `envs`. Elsewhere (no such dict) every call reads `envs`.
_ENVIRON = os.environ
_DATA = getattr(os.environ, "_data", None)
_KEY = os.environ.encodekey(NAME) if type(_DATA) is dict and hasattr(os.environ, "encodekey") else None


class InjectedFault(RuntimeError):
    pass


def active() -> str | None:
    return STAGE if STAGE is not None else envs.get(NAME)


def check(stage: str) -> None:
    if STAGE is None and _KEY is not None and os.environ is _ENVIRON and _KEY not in _DATA:  # type: ignore[operator]
        return  # (nothing injected: the environment does not name the setting)
    if active() == stage:
        raise InjectedFault(f"fault injected at stage {stage!r} ({NAME})")
