"""Probe payloads of finished requests, made while the engine is idle (a step that ran no tokens) rather
than when the fetch asks: an offline `generate` fetches only after the frontend has processed the last
step's outputs, and the engine core has nothing to do meanwhile. The payload is what the fetch would make
(`probe_payloads.together` as blocks, else `probes.payload`) from the same filed rows: vLLM names a request
finished only after every step that scored it was filed, and nothing is filed for it after that. Such a step
often comes while the device still runs the last one (vLLM schedules ahead): the requests that finished
before it are made then, from records every step has run on. A fetch uses what was made
(`fetch._probes_together`); where none was made the fetch makes it as before."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from vllm_worker.counters import FETCH_TIMINGS
from vllm_worker.envs import get
from vllm_worker.worker import fetch, probe_payloads, probes
from vllm_worker.worker.request_results import RequestResults


def note_finished(requests: dict[str, Any], req_ids: Any) -> None:
    """vLLM names these requests finished (`requests`: the worker's request states by vLLM's id, before the
    step that drops them): nothing more is filed for them."""
    for rid in req_ids:
        r = requests.get(rid)
        if r is not None and r.store is not None and r.store.probe_filed:
            r.store.finished = True


def prepare(stores: Iterable[RequestResults], running: Callable[[], bool] | None = None) -> int:
    """Make the probe payloads of the finished requests among `stores` that have none yet, as the fetch
    would: together (`probe_payloads`), else one request at a time (`probes.payload`); returns how many were
    made. A request whose payload fails here has none made: its fetch makes it, where a failure is its error.
    `running`: the device still runs a step (vLLM scheduled ahead): then only the requests whose every record
    has run (`StepRecord.ran`) are made, a chunk at a time while `running()` holds, so that the step's
    outputs wait for none of this; the others are made at the next idle step (or by their fetch)."""
    if not get("VLLM_LENS_IDLE_PROBES"):
        return 0
    sts = [st for st in stores if st.finished and st.ready is None and st.error is None and st.probe_filed]
    if running is not None:
        seen: dict[int, bool] = {}
        sts = [st for st in sts if _ran(st, seen)]
    if not sts:
        return 0
    t = time.perf_counter()
    records = fetch.shared_records(len(sts))
    step = len(sts) if running is None else EARLY_CHUNK
    made = 0
    for i in range(0, len(sts), step):
        if running is not None and not running():
            break
        made += _make(sts[i : i + step], records)
    FETCH_TIMINGS["ready_made"] += made
    if running is not None:
        FETCH_TIMINGS["ready_early"] += made
    FETCH_TIMINGS["ready_s"] += time.perf_counter() - t
    return made


EARLY_CHUNK = 64  # requests made between two looks at whether the device's step has ended


def _ran(st: RequestResults, seen: dict[int, bool]) -> bool:
    """Every record `st`'s probe scores were filed in has run (`seen`: each record asked once)."""
    for entry in st.probe_filed:
        rec = entry[0].record
        got = seen.get(id(rec))
        if got is None:
            got = seen[id(rec)] = rec.ran()
        if not got:
            return False
    return True


def _make(sts: list[RequestResults], records: dict | None) -> int:
    got = probe_payloads.together(sts, records, blocks=True) if records is not None else [None] * len(sts)
    made = 0
    for st, p in zip(sts, got):
        if p is None:
            try:
                p = probes.payload(st.probes, cache=records)
            except Exception:  # noqa: BLE001 - left to the fetch (see `prepare`)
                continue
        st.ready = p
        made += 1
    return made
