"""Filing a batch's steps the way the worker does, for tests of what is read back from step records: a
prefill, then decode steps in which the requests still running form one composition (new records) each
time one of them finishes."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


def file_steps(
    stage: Callable[[list[int], int], Any],
    file: Callable[[Any, np.ndarray], None],
    lengths: list[int],
    prefill: int,
    redo: tuple[int, int] | None = None,
) -> None:
    """`stage(live, rows)`: a composition of the live requests with `rows` rows each; `file(stage, positions)`:
    one step's filing. Request i runs until position `lengths[i]`; `redo=(step, position)`: that step files
    `position` again (a preempted request's recompute)."""
    live = list(range(len(lengths)))
    file(stage(live, prefill), np.tile(np.arange(prefill), len(live)))
    step = prefill
    live = [r for r in live if lengths[r] > step]
    while live:
        gp = stage(live, 1)
        end = min(lengths[r] for r in live)
        while step < end:
            at = redo[1] if redo is not None and step == redo[0] else step
            file(gp, np.full(len(live), at, dtype=np.int64))
            step += 1
        live = [r for r in live if lengths[r] > end]
