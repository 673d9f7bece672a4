"""Where a round's result tail goes on the host that runs it (W9 / W10's fetch of probe scores), in a real
in-process engine (GPU with CUDA graphs, or the CPU engine): the bench's batch, `--rounds` times per
workload, the garbage collector frozen after the first round (as the bench's processes). Per round, wall and
thread-CPU ms of the fetch (`frontend.fetch._fetch`: the worker's call, in this process) with its parts (the
worker's `assemble_all`, the records' host copies `Span._whole`, `probe_payloads.payloads`) and of the
frontend's decoding (`frontend.fetch._apply`, its `probe_outputs_many`), the young collections that ran
inside them, then `_apply` again on the same fetched results (warm: the data just read) — cold / warm tells
the first touch of the reply from the work itself. A last round runs under cProfile (the fetch and the
decoding only) and prints the functions with the most own time, torch's included.

    [VLLM_ENABLE_V1_MULTIPROCESSING=1] python bench/probes/tail_host.py MODEL [--device cuda]
        [--workloads W0,W9,W10] [--rounds 3] [--idle-replay 1] [--alternate-gc]

With `VLLM_ENABLE_V1_MULTIPROCESSING=1` the engine core runs in its own process, as in the bench: the worker's
parts are then not timed here (its assembly is read from `lens_status`), the fetch is the round trip.

`--idle-replay s`: `_apply` replayed once more after `s` seconds asleep — slower than the warm replay right
after the round when the host's cores clock down while idle (a tail is a burst after the steps' waits).
`--alternate-gc`: odd rounds run the fetch and the decoding with the collector off (its deferred young
collections then run after them, outside the tail's timers).
"""

from __future__ import annotations

import collections
import cProfile
import gc
import importlib
import io
import pstats
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_host import bench_args, bench_engine  # noqa: E402  (bench/probes: beside this script; sets up sys.path)

# (module, owner attribute or "", function, label): the parts timed in a round's tail
PARTS = [
    ("vllm_worker.frontend.fetch", "", "_fetch", "fetch"),
    ("vllm_worker.worker.fetch", "", "assemble_all", "assemble"),
    ("vllm_worker.worker.probe_payloads", "", "payloads", "payloads"),
    ("vllm_worker.worker.step_records", "Span", "_whole", "whole"),
    ("vllm_worker.frontend.fetch", "", "_apply", "apply"),
    ("vllm_worker.frontend.fetch", "", "probe_outputs_many", "outputs_many"),
]
PROFILED = ("fetch", "apply")


class Tail:
    """Timers around `PARTS` (wall and thread ms, calls), a profiler switched on inside `PROFILED`, young
    collections counted, and `_apply`'s last arguments kept for a warm replay."""

    def __init__(self) -> None:
        self.wall: collections.Counter = collections.Counter()
        self.cpu: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.prof: cProfile.Profile | None = None
        self.applied: tuple | None = None
        self.apply: Any = None
        self.gcs: collections.Counter = collections.Counter()
        self._gc_t = 0.0
        self.depth = 0  # inside a timed part: its collections counted
        self.gc_off = False  # the collector off inside `PROFILED` (`--alternate-gc`)
        self.replaying = False  # timers off (the replay is timed whole)
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        if not self.depth:
            return
        if phase == "start":
            self._gc_t = time.perf_counter()
        else:
            self.gcs[f"gen{info['generation']}"] += 1
            self.gcs["ms"] += (time.perf_counter() - self._gc_t) * 1e3

    def install(self) -> None:
        for mod, owner, name, label in PARTS:
            m = importlib.import_module(mod)
            where = getattr(m, owner) if owner else m
            f = getattr(where, name)
            if label == "apply":
                self.apply = f
            setattr(where, name, self._wrap(f, label))

    def _wrap(self, f: Any, label: str) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            if self.replaying:
                return f(*a, **k)
            if label == "apply":
                self.applied = a
            p = self.prof if label in PROFILED else None
            if p is not None:
                p.enable()
            off = self.gc_off and label in PROFILED and gc.isenabled()
            if off:
                gc.disable()
            s, c = time.perf_counter(), time.thread_time()
            self.depth += 1
            try:
                return f(*a, **k)
            finally:
                self.depth -= 1
                if off:
                    gc.enable()
                self.wall[label] += (time.perf_counter() - s) * 1e3
                self.cpu[label] += (time.thread_time() - c) * 1e3
                self.calls[label] += 1
                if p is not None:
                    p.disable()

        return timed

    def clear(self) -> None:
        for c in (self.wall, self.cpu, self.calls, self.gcs):
            c.clear()

    def replay(self, times: int = 3) -> list[float]:
        """Wall ms of `_apply` run again on the last round's arguments (their data just read), the collector
        as in the round's tail."""
        out = []
        self.replaying = True
        off = self.gc_off and gc.isenabled()
        if off:
            gc.disable()
        try:
            for _ in range(times):
                s = time.perf_counter()
                self.apply(*self.applied)
                out.append(round((time.perf_counter() - s) * 1e3, 2))
        finally:
            self.replaying = False
            if off:
                gc.enable()
        return out


def main() -> None:
    ap = bench_args("W0,W9,W10", rounds=3, top=25)
    ap.add_argument("--idle-replay", type=float, default=0.0, help="replay again after sleeping this many s")
    ap.add_argument("--alternate-gc", action="store_true", help="odd rounds: the collector off in the tail")
    a = ap.parse_args()
    from vllm import SamplingParams

    llm, extra, prompts = bench_engine(a.model, a.device, a.n)
    tail = Tail()
    tail.install()
    print(f"TAIL_HOST device={a.device} model={a.model} n={a.n} new={a.new}", flush=True)
    print("  threads:", sorted(t.name for t in threading.enumerate()), flush=True)
    frozen = False
    last: dict = {}  # the worker's cumulative fetch timings (its process's in a multiprocess engine)
    for w in a.workloads.split(","):
        sp = [SamplingParams(max_tokens=a.new, temperature=0, ignore_eos=True, extra_args=extra(w)) for _ in prompts]
        print(f"== {w}", flush=True)
        for r in range(a.rounds + 1):
            tail.clear()
            tail.applied = None
            tail.prof = cProfile.Profile() if r == a.rounds else None
            tail.gc_off = a.alternate_gc and r % 2 == 1
            t = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            wall = (time.perf_counter() - t) * 1e3
            fetch_t = llm.collective_rpc("lens_status")[0]["fetch_timings"]
            worker = f"worker assemble {(fetch_t['assemble_s'] - last.get('assemble_s', 0)) * 1e3:.2f} ms"
            last = fetch_t
            if not frozen:  # (after the first round, as the bench freezes its processes' heaps after warm-up)
                gc.collect()
                gc.freeze()
                frozen = True
            if tail.prof is not None:
                s = io.StringIO()
                pstats.Stats(tail.prof, stream=s).sort_stats("tottime").print_stats(a.top)
                print("  cProfile of the fetch and the decoding (own time first):")
                print("\n".join("   " + line for line in s.getvalue().splitlines()[4:] if line.strip()))
                continue
            cells = " ".join(
                f"{k}={tail.wall[k]:.2f}/{tail.cpu[k]:.2f}" + (f"x{tail.calls[k]}" if tail.calls[k] > 1 else "")
                for _, _, _, k in PARTS
                if tail.calls[k]
            )
            warm = tail.replay() if tail.applied is not None else []
            if tail.applied is not None and a.idle_replay:
                time.sleep(a.idle_replay)  # (the host's other threads gone idle: a replay not contended)
                warm += ["idle"] + tail.replay(2)
            gcs = " ".join(f"{k}={v:.2f}" if k == "ms" else f"{k}={v}" for k, v in sorted(tail.gcs.items()))
            off = " (gc off in the tail)" if tail.gc_off else ""
            print(
                f"  round {r}{off} wall {wall:.1f} ms | wall/cpu ms: {cells} | {worker} | apply warm {warm} | gc {gcs}",
                flush=True,
            )


if __name__ == "__main__":
    main()
