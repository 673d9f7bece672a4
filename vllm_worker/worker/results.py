"""Transitional: `store`, `runtime`, `edits` and `admission` still import from here; at the merge they import
from `worker.request_results` (and `counters` for FETCH_TIMINGS, `ArenaSpan` for Segment) and this module is
deleted."""

from vllm_worker.counters import FETCH_TIMINGS  # noqa: F401
from vllm_worker.worker.request_results import ArenaSpan as Segment  # noqa: F401
from vllm_worker.worker.request_results import CaptureLog, RequestResults, StepArena  # noqa: F401
