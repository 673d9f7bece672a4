"""A fetch's results assembled: each request's payload (error, hook state, SAE features) and its captures,
finished in place when assembled early (`transport.early`), else copied from the step arenas into the result
pool all at once (`transport.assembly`), or as bytes when the frontend is on another machine. A failure of
our own code here is that request's error, never the fetch's. (`store.CaptureStore.fetch` picks the
requests and claims their regions.)"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from vllm_worker.counters import FETCH_TIMINGS
from vllm_worker.envs import get
from vllm_worker.protocol import errors, probe_wire
from vllm_worker.protocol.wire import tensor_to_bytes
from vllm_worker.transport import assembly, early
from vllm_worker.transport.early_regions import State
from vllm_worker.transport.result_pool import ResultPool, host_array
from vllm_worker.worker import actions, faults, probe_payloads, probes, saes, step_records
from vllm_worker.worker.request_results import RequestResults

logger = logging.getLogger("vllm_worker")


ASSEMBLY_BYTES_PER_THREAD = 128 << 20


def max_threads() -> int:
    """At most this many threads copy a fetch's captures into the result pool (`VLLM_LENS_ASSEMBLY_THREADS`);
    the copies release the GIL (`assembly`), so threads really run in parallel."""
    return max(1, get("VLLM_LENS_ASSEMBLY_THREADS"))


def assembly_threads(nbytes: int) -> int:
    """Threads for a fetch of `nbytes`: one per ASSEMBLY_BYTES_PER_THREAD, at most `max_threads()`."""
    return max(1, min(max_threads(), nbytes // ASSEMBLY_BYTES_PER_THREAD))


def executor(threads: int) -> Any:
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lens-assemble")


def assemble_all(
    todo: list,
    layer_ids: list[int],
    assemble_saved: Any,
    pool: ResultPool | None,
    early_asm: early.EarlyAssembler | None = None,
    claimed: dict[int, early.EarlyRegion] | None = None,
) -> list:
    """Into the result pool: requests assembled early (`early`) are finished in place, the others all
    at once (`assembly`), in a few threads for large fetches. As bytes (no pool: another machine, or
    no room): one request at a time."""
    claimed = claimed or {}
    out: list[dict | None] = [None] * len(todo)
    items, where = [], []
    records = shared_records(len(todo))
    scored = _probes_together(todo, records)
    actions.read_together([st for _, _, st, _ in todo if st.error is None])
    for i, (_, _, st, n) in enumerate(todo if pool is not None else ()):
        dest = claimed.pop(id(st), None)
        used = False
        try:
            payload, mine, out_of_slot = _prelude(st, layer_ids, assemble_saved, records, scored.get(id(st)))
            if dest is not None and early_asm is not None and mine is not None:
                got = early_asm.finish(payload, st, n, mine, dest)
                if got is not None:
                    used = True
                    FETCH_TIMINGS["early_requests"] += 1
                    out[i] = got
        except Exception as e:  # noqa: BLE001
            out[i] = _internal(e)
        if dest is not None and not used and early_asm is not None:
            early_asm.free_now(dest)  # not used: assembled below from the arenas
        if out[i] is not None:
            continue
        if mine is not None and (dest is not None or st.early is State.FAILED):
            FETCH_TIMINGS["early_fallbacks"] += 1
        if mine is None:
            out[i] = payload
        else:
            items.append((payload, st, n, mine, out_of_slot))
            where.append(i)
    for dest in claimed.values():  # fetched without the pool: assembled as bytes
        if early_asm is not None:
            early_asm.free_now(dest)
        FETCH_TIMINGS["early_fallbacks"] += 1
    threads = assembly_threads(sum(_result_bytes(it[1], it[2]) for it in items))
    if items:
        assert pool is not None  # items are gathered only with a pool
        try:
            for i, item, assembled in zip(
                where, items, assembly.assemble(items, pool, threads, executor, FETCH_TIMINGS)
            ):
                # None: no room in the pool, so as bytes (its prelude is done)
                out[i] = assembled if assembled is not None else _guarded(_as_bytes, *item)
        except Exception as e:  # noqa: BLE001 - our own failure: these requests' error, not the fetch's
            for i in where:
                out[i] = _internal(e)
    for i, (_, _, st, n) in enumerate(todo):
        if out[i] is None:
            out[i] = _guarded(_assemble, st, n, layer_ids, assemble_saved, records, scored.get(id(st)))
    return out


def _probes_together(todo: list, records: dict | None) -> dict[int, Any]:
    """{id(request results): probe payload} of the fetch's requests whose probe scores are computed together
    (`probe_payloads`), or were while the engine was idle (`ready_probes`); the others' are made one request
    at a time (`probes.payload`) in `_prelude`. A failure here leaves every request to that path (where a
    failure is that request's error)."""
    sts = [st for _, _, st, _ in todo if st.has_probes and st.error is None]
    out = {id(st): st.ready for st in sts if st.ready is not None}  # made while the engine was idle
    if out:
        FETCH_TIMINGS["ready_used"] += len(out)
        sts = [st for st in sts if st.ready is None]
    if records is None or not sts:
        return out
    got = probe_payloads.together(sts, records, blocks=True)
    out.update((id(st), p) for st, p in zip(sts, got) if p is not None)
    return out


def shared_records(n_requests: int) -> dict | None:
    """The step-record cache of a fetch of `n_requests`: with more than one, each record's rows are copied
    to the host once for all of them (`step_records.WHOLE_RECORDS`) instead of once per request and site;
    a lone request copies only its own rows (a record may hold many still-running requests)."""
    return {step_records.WHOLE_RECORDS: True} if n_requests > 1 else None


def _internal(e: Exception) -> dict[str, Any]:
    logger.error("inspect-lens: assembling a request's results failed: %s: %s", type(e).__name__, e)
    return {
        "error": errors.failure(
            "internal",
            f"inspect-lens internal error while assembling results: {type(e).__name__}: {e}",
            "assembling results",
        )
    }


def _guarded(fn: Any, *args: Any) -> dict[str, Any]:
    """One request's payload; a failure of our own code here is that request's error, not the fetch's."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return _internal(e)


def _prelude(
    st: RequestResults,
    layer_ids: list[int],
    assemble_saved: Any,
    records: dict | None = None,
    scored: Any = None,
) -> tuple[dict, list[int] | None, dict]:
    """The payload without captures (error, hook state), the captured layers this rank holds (None: no
    captures to assemble) and capture slot -> output index. `records`: the fetch's step-record cache;
    `scored`: the request's probe payload when the fetch made it with others' (`_probes_together`: items
    by probe, or a block)."""
    if st.layers:
        faults.check("assemble")
    payload: dict[str, Any] = {}
    if st.error is None and st.nonfinite:
        bad = [where for where, flag in st.nonfinite.items() if bool(flag)]
        if bad:
            st.error = errors.failure(
                "hook",
                f"{bad[0]} returned NaN or inf values; they were not written into the stream (hooks that did: {bad})",
                "hook output",
            )
    if st.error is not None:
        payload["error"] = st.error
    if st.saved:
        payload["hooks"] = assemble_saved(st.saved)
    if st.sae and st.error is None:
        payload["sae"] = saes.payload(st.sae, records)
    if st.actions is not None and st.error is None:
        payload["actions"] = st.actions() if callable(st.actions) else st.actions
    if st.has_probes and st.error is None:
        if type(scored) is tuple:  # its probes as one block (`probe_wire.pack_block`)
            payload["probes"], payload[probe_wire.BLOCK] = scored
        else:
            payload["probes"] = scored if scored is not None else probes.payload(st.probes, cache=records)
    mine = [l for l in st.layers if l in layer_ids]
    if not mine:  # no captures, or (pipeline parallelism) all of them on other stages: theirs to report
        return payload, None, {}
    return payload, mine, {st.layers.index(l): i for i, l in enumerate(mine)}


def _result_bytes(st: RequestResults, n_pos: int) -> int:
    """Size of a request's assembled captures (0 without any)."""
    for seg in st.segments:
        arena = seg.log.arena
        if arena is not None and arena.chunks:
            data = arena.chunks[0][0]
            return len(st.layers) * n_pos * data.shape[-1] * data.element_size()
    return 0


def _assemble(
    st: RequestResults,
    n_pos: int,
    layer_ids: list[int],
    assemble_saved: Any,
    records: dict | None = None,
    scored: Any = None,
) -> dict[str, Any]:
    """One request, as bytes (no result pool: a frontend on another machine)."""
    payload, mine, out_of_slot = _prelude(st, layer_ids, assemble_saved, records, scored)
    return payload if mine is None else _as_bytes(payload, st, n_pos, mine, out_of_slot)


def _as_bytes(payload: dict, st: RequestResults, n_pos: int, mine: list[int], out_of_slot: dict) -> dict[str, Any]:
    """A request's captures copied into a tensor of its own, sent as bytes in the RPC reply."""
    parts = [
        (out_of_slot[seg.slot], pos, rows)
        for seg in st.segments
        if seg.log.arena is not None and seg.slot in out_of_slot
        for pos, rows in seg.log.arena.parts(seg.log.col + seg.offset, seg.n)
    ]
    if not parts:
        payload.setdefault("error", errors.failure("internal", "no positions were captured", "assembling results"))
        return payload
    d, dtype = parts[0][2].shape[-1], parts[0][2].dtype
    shape = (len(mine), n_pos, d)
    t1 = time.perf_counter()
    t = torch.zeros(shape, dtype=dtype)
    dst = host_array(t)
    t2 = time.perf_counter()
    FETCH_TIMINGS["alloc_s"] += t2 - t1
    filled = np.zeros((len(mine), n_pos), dtype=bool)
    for slot, pos, rows in parts:  # pos (steps, n), rows (steps, n, d)
        p = host_array(pos).ravel()
        src = host_array(rows)
        if (
            len(p)
            and p[0] >= 0
            and p[-1] - p[0] == len(p) - 1
            and p[-1] < n_pos
            and (len(p) < 3 or np.array_equal(np.diff(p), np.ones(len(p) - 1, dtype=p.dtype)))
        ):
            # one request's decode steps / prefill chunk: one block copy
            np.copyto(dst[slot, p[0] : p[-1] + 1].reshape(src.shape), src)
            filled[slot, p[0] : p[-1] + 1] = True
            continue
        src = src.reshape(-1, d)
        keep = p < n_pos
        if not keep.all():
            p, src = p[keep], src[keep]
        dst[slot, p] = src
        filled[slot, p] = True
    FETCH_TIMINGS["copy_s"] += time.perf_counter() - t2
    assembly.note_missing(payload, mine, filled)
    payload.update({"layers": mine, "tensor": tensor_to_bytes(t)})
    return payload
