"""Seams: Python hooks between the pieces of a full CUDA graph, so a step with hooks keeps its graphs.

A full CUDA graph (vLLM's decode steps) replays the whole forward with no Python in it, so without seams
a step whose requests carry Python hooks runs off full graphs: piecewise graphs with our taps called from
Python at every layer, paid by every request of the batch (figures: docs/decisions.md, "Python hooks").

Here, each time vLLM captures a full graph (once per batch size, at start-up), the same forward is
captured a second time cut after every tap between layers: a list of graph segments, each ending with
the graph-safe kernel of one site (`taps.set_recorder`). A step whose only Python is hooks at such sites
(`plan.StepPlan.seam_sites`; capture and steering stay on the kernel) replays the segments in order and
runs the handler after the segments of its hooked sites only; other cuts cost one graph launch. The
tensors the handler gets are the captured ones (same addresses on every replay), so what a hook writes
is what the next segment reads.

Captured inside vLLM's own capture (same inputs, attention metadata and memory pool, the pool's
tensors referenced weakly as vLLM does), never while serving. `compat.patch_full_graphs` routes the
calls.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from vllm_worker import compat, envs
from vllm_worker.counters import SEAM_STATS
from vllm_worker.worker import taps

logger = logging.getLogger("vllm_worker")

_wanted: frozenset = frozenset()  # sites with Python hooks in the running step (empty: none)


def enabled() -> bool:
    return bool(envs.get("VLLM_LENS_SEAMS"))


def set_wanted(sites: frozenset) -> frozenset:
    """The running step's hooked sites (set by the runtime around the forward); returns the previous."""
    global _wanted
    prev, _wanted = _wanted, sites
    return prev


def wanted() -> bool:
    return bool(_wanted)


def ready() -> bool:
    """Cut graphs exist in this process (a GPU engine with full CUDA graphs captured them)."""
    return SEAM_STATS["captured"] > 0


class CutForward:
    """One forward captured as graph segments; `cut` ends one after a tap and starts the next."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.parts: list[tuple[Any, int | None, Any, Any]] = []  # (graph, site after it, hidden, residual)
        self.output: Any = None
        self._g: Any = None

    def begin(self) -> None:
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self.pool)
        self._g = g

    def cut(self, hidden: torch.Tensor, residual: torch.Tensor | None, site: int) -> None:
        if self._g is None or not torch.cuda.is_current_stream_capturing():
            return
        self._g.capture_end()
        self.parts.append((self._g, site, compat.weak_ref(hidden), compat.weak_ref(residual)))
        self._g = None
        self.begin()

    def end(self) -> None:
        if self._g is not None:
            g, self._g = self._g, None
            g.capture_end()
            self.parts.append((g, None, None, None))

    def replay(self, sites: frozenset) -> Any:
        for g, site, hidden, residual in self.parts:
            g.replay()
            if site is not None and site in sites:
                taps.run_handler(hidden, residual, site)
        return self.output


def capture(pool: Any, forward: Callable[[], Any]) -> CutForward | None:
    """`forward()` captured as segments cut at the taps (called by `compat.patch_full_graphs` right after
    vLLM captured its own full graph for the same batch). None when off, or when capture failed: such
    steps then run eagerly; vLLM's own graph is untouched either way."""
    if not enabled() or taps._graph is None:
        return None
    seg = CutForward(pool)
    prev = taps.set_recorder(seg)
    try:
        seg.begin()
        out = forward()
        seg.output = compat.weak_refs(out)
        del out
        seg.end()
    except Exception as e:  # noqa: BLE001 - vLLM's graph is already captured; steps with hooks run eagerly
        try:
            seg.end()
        except Exception:  # noqa: BLE001
            pass
        SEAM_STATS["capture_failures"] += 1
        logger.warning("inspect-lens: cutting a full CUDA graph at the taps failed (%s: %s)", type(e).__name__, e)
        return None
    finally:
        taps.set_recorder(prev)
    SEAM_STATS["captured"] += 1
    SEAM_STATS["segments"] += len(seg.parts)
    return seg


def replay(seg: CutForward) -> Any:
    SEAM_STATS["replays"] += 1
    return seg.replay(_wanted)


def fallback() -> None:
    SEAM_STATS["eager_fallbacks"] += 1
