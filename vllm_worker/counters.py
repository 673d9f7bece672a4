"""Diagnostics counters: cumulative, module-level, bumped on the hot path without a lock (a lost increment
between threads costs a count, never a result), read by `lens_status` and the benchmarks. Nothing in the
plugin decides anything from them. Each process has its own: the worker's are reported per worker, the
frontend's are read in the frontend (bench/worker.py)."""

from __future__ import annotations

import collections
import time

# ---------------------------------------------------------------- worker processes

# Diagnostics (reported by `status`, read by benchmarks): cumulative seconds in fetches.
FETCH_TIMINGS = {
    "wait_copies_s": 0.0,
    "assemble_s": 0.0,
    # summed over assembly threads: taking result memory (pool regions), copying into it
    "alloc_s": 0.0,
    "index_s": 0.0,
    "copy_s": 0.0,
    "arena_alloc_s": 0.0,  # host memory for steps' captures, allocated in the step
    # probe payloads made while the engine was idle (`ready_probes`): requests, seconds, and those a fetch used
    "ready_made": 0,
    "ready_s": 0.0,
    "ready_used": 0,
    "ready_early": 0,  # of `ready_made`: made while the device still ran a step (`ready_probes.prepare`)
    # early assembly (`transport.early`): requests whose result was written while they ran, requests that
    # wanted it and were assembled at fetch instead, the fetch's wait for the copies not yet done, and the
    # background thread's work (batches of filed steps, bytes, index building, copies, regions of dropped
    # requests freed, layers moved together for requests that stopped early)
    "early_requests": 0,
    "early_fallbacks": 0,
    "early_flush_s": 0.0,
    "early_batches": 0,
    "early_bytes": 0,
    "early_index_s": 0.0,
    "early_copy_s": 0.0,
    "early_freed": 0,
    "early_compact_s": 0.0,
    # direct mode (`VLLM_LENS_DIRECT_POOL`): regions taken in the step, steps whose rows the GPU wrote into
    # them, the rows, and the step thread's seconds building the offsets and issuing the writes
    "direct_regions": 0,
    "direct_steps": 0,
    "direct_only_steps": 0,  # ... of which every row went directly (no arena rows, no host copy at all)
    "direct_rows": 0,
    "direct_s": 0.0,
    "direct_joins": 0,  # requests that joined an arena's direct members after its first step
}

# cut CUDA graphs (`worker.seams`): graphs captured, their segments, steps replayed through them, steps that
# wanted one and ran eagerly because none was captured for their batch size, captures that failed
SEAM_STATS = {"captured": 0, "segments": 0, "replays": 0, "eager_fallbacks": 0, "capture_failures": 0}

# rows this process encoded for SAE features / clamped (`worker.saes`): which rank did the work (TP: features
# on the reporting rank only, clamps on every rank; PP: the stage holding the SAE's layer)
SAE_COUNTS = {"feature_rows": 0, "clamp_rows": 0}

# host seconds around graph-path steps, cumulative.
STEP_TIMINGS = {
    "graph_steps": 0,
    "plan_s": 0.0,
    "forward_s": 0.0,
    "after_s": 0.0,
    "python_steps": 0,
    "python_file_s": 0.0,
    "graphless_steps": 0,  # steps kept off every CUDA graph (Python at a tap inside a layer)
    "seam_steps": 0,  # graph-path steps with Python hooks at some taps (`seams`)
    "deferred_sites": 0,  # taps whose read-only hooks ran after the forward (`StepPlan.defer_hooks`)
    "reused_tables": 0,  # graph-path steps whose table was already on the device (`GraphTaps.reuse`)
    "admit_s": 0.0,  # admitting new requests (decoding their specs, steering entries) at their first step
    # batch compositions that admitted requests, and the requests admitted (a batch of n requests reaching
    # the engine core together: 1 and n; spread over k steps: k)
    "admit_steps": 0,
    "admitted": 0,
    "replans": 0,  # batch compositions planned (`REPLANS`), and their host seconds
    "replan_s": 0.0,
}

# `lens_forward_clock`: (start, end, CPU seconds of the calling thread at
# start) of the latest forward passes on the `time.monotonic` clock (one clock for every process of the
# machine), so a benchmark can split a call's wall time into before the first step, the step loop and after
# the last step, and tell a step loop that computes from one that waits (for the GIL, for the device).
FORWARD_CLOCK: collections.deque = collections.deque(maxlen=4096)

# `lens_replan_clock`: (start on the same clock, seconds, batch requests) of each re-plan (a batch
# composition changed: requests pruned, admitted, the plan made), which runs after the previous forward and
# before the next one starts — host time the device may wait through, not inside any forward's entry
REPLANS: collections.deque = collections.deque(maxlen=4096)


def replanned(t0: float, requests: int) -> None:
    """A re-plan that started at `t0` (`time.monotonic`) ends now."""
    dt = time.monotonic() - t0
    REPLANS.append((t0, dt, requests))
    STEP_TIMINGS["replans"] += 1
    STEP_TIMINGS["replan_s"] += dt


# where the time of Python hooks goes, cumulative host
# seconds — inside the users' functions, and around them (slicing, the stream sum, checks).
HOOK_TIMINGS = {"calls": 0, "in_hooks_s": 0.0, "around_hooks_s": 0.0}

# ---------------------------------------------------------------- the frontend process

# where time goes after generation (offline, `frontend.fetch`): seconds in worker RPCs and in decoding
FRONTEND_TIMINGS = {"fetch_rpc_s": 0.0, "decode_s": 0.0}

# ---------------------------------------------------------------- API server process

# streaming with probe scores (`server.probe_progress`): progress RPCs sent, the chunks' asks they served,
# their round trips and the pauses between them (seconds)
STREAM_PROGRESS = {"rpcs": 0, "asks": 0, "rpc_s": 0.0, "pause_s": 0.0}
# async fetches (the HTTP server's responses, `AsyncLLM` callers) and the batches they went in together
# (`frontend.fetch.FetchBatcher`)
FETCH_BATCHES = {"batches": 0, "fetches": 0}

# named vectors (`frontend.vector_refs`): steers sent by reference (no bytes), registrations dropped on the workers
VECTOR_REFS = {"sent": 0, "drops_sent": 0}
