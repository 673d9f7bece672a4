"""Where a worker process's host CPU goes, for benchmarks (`lens_rusage`): each thread's CPU seconds (the
thread that runs the steps is one; vLLM's input and output threads, ours and the driver's are the others),
and with `VLLM_LENS_HOST_CLOCK` its garbage collections by thread. A thread that burns CPU beside the step
thread takes the GIL from it; a full collection stalls whichever thread triggers it. Neither shows in the
step thread's own clock."""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

from vllm_worker import envs

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_TASKS = "/proc/self/task"


def threads_cpu() -> dict[str, float]:
    """{thread: user + system CPU seconds} of every thread of this process that has used any (Linux; {}
    elsewhere). A thread is named as Python names it, else by its kernel name, with its id where names
    repeat."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[str, float] = {}
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # (a thread that ended meanwhile)
            continue
        comm_end = stat.rfind(b")")
        fields = stat[comm_end + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15 of stat)
        if not cpu:  # (idle threads: NCCL's and gloo's many)
            continue
        name = names.get(int(tid)) or stat[stat.find(b"(") + 1 : comm_end].decode(errors="replace")
        if name in out:
            name = f"{name}#{tid}"
        out[name] = cpu
    return out


class GcClock:
    """This process's garbage collections: per thread that ran them, count and seconds per generation."""

    def __init__(self) -> None:
        self._t0: float | None = None
        self.by: dict[str, dict[str, float]] = {}
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            g = int(info.get("generation", -1))
            got = self.by.setdefault(threading.current_thread().name, {})
            got[f"gen{g}"] = got.get(f"gen{g}", 0) + 1
            got[f"gen{g}_s"] = got.get(f"gen{g}_s", 0.0) + time.perf_counter() - self._t0
            self._t0 = None

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Cumulative {thread: {"gen<g>": collections, "gen<g>_s": seconds}}."""
        return {t: dict(v) for t, v in self.by.items()}


_CLOCK: list[GcClock] = []


def start() -> None:
    """The collections' clock, once per process, when `VLLM_LENS_HOST_CLOCK` is set (read at start-up)."""
    if not _CLOCK and envs.get("VLLM_LENS_HOST_CLOCK"):
        _CLOCK.append(GcClock())


def report() -> dict[str, Any]:
    """`lens_rusage`'s part: {"threads": `threads_cpu()`} and, with the clock on, {"gc": its snapshot}."""
    out: dict[str, Any] = {"threads": threads_cpu()}
    if _CLOCK:
        out["gc"] = _CLOCK[0].snapshot()
    return out
