"""Named vectors by reference: a registered vector's rows are pushed to every worker once, at register
time, under the registration's id (`Entry.vid`), and a request naming it sends that id instead of the
bytes (W12 at the 8B shape: 512 KB a request, copied, serialised, sent to the engine core, decoded there
on the thread that feeds it, and again in the worker).

Exact: a steer goes by reference only when its validated rows (`Steer.digest`, SHA-256 of the bytes the
request would have sent) equal the pushed rows repeated as the worker will repeat them; anything else
(heads, mlp_post pieces, probe actions, a digest that differs) carries its bytes as before. Miss-safe: a
request pins the registrations it names until its pending entry goes (fetched or aborted), and a replaced
or deleted registration is dropped on the workers only once unpinned (the drop rides the next message),
so a request in flight keeps the numbers of the vector it named. Only where it can be guaranteed: one
engine core (data parallel engines get bytes) and a frontend that fetches every request (a consumer)."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

from vllm_worker import compat
from vllm_worker.counters import VECTOR_REFS
from vllm_worker.frontend.state import engine_state
from vllm_worker.frontend.steer_rows import checked_rows
from vllm_worker.frontend.vectors import Entry, VectorRegistry
from vllm_worker.protocol import rpc
from vllm_worker.protocol.ops import ABLATE, CAP
from vllm_worker.protocol.spec import VECTOR_REFS_KEY, RequestSpec

logger = logging.getLogger(__name__)


@dataclass
class Held:
    """What the workers hold of one registration: its rows as float32 (a 1-D vector as one row) and their
    unit rows (None: a zero row has no direction), and the digests of each form repeated, as requests use it."""

    plain: bytes
    unit: bytes | None
    shape: tuple[int, ...]
    digests: dict[tuple[bool, int], bytes] = field(default_factory=dict)

    def wire(self, vid: str) -> list[Any]:
        return [vid, self.plain, self.unit, list(self.shape)]

    def digest(self, unit: bool, repeat: int) -> bytes | None:
        form = self.unit if unit else self.plain
        if form is None:
            return None
        key = (unit, repeat)
        got = self.digests.get(key)
        if got is None:
            got = self.digests[key] = hashlib.sha256(form * repeat).digest()
        return got


def forms(entry: Entry) -> Held:
    """The rows validation makes of `entry` (`steer_rows.checked_rows`: the same passes, the same bits)."""
    t = entry.tensor
    rows = t.reshape(1, -1) if t.ndim == 1 else t
    plain = _dense(checked_rows(rows, "add", "activations"))
    try:
        unit = _dense(checked_rows(rows, "ablate", "activations"))
    except ValueError:  # a zero row: ablate / cap refuse it by bytes, with the error naming the request's field
        unit = None
    return Held(plain, unit, tuple(rows.shape))


def _dense(got: Any) -> bytes:
    """All of `checked_rows`' rows as bytes: rows all equal come with only their first row's (`repeat`), and
    `Held` keeps every row of its shape (its digests are of them, as a request's are)."""
    return got.raw * got.repeat if got.repeat else got.raw


def push(llm: Any, processor: Any, registry: VectorRegistry, entry: Entry) -> None:
    """Offline (`llm.register_vector`): `entry` onto every worker; on any failure requests naming it carry
    the bytes (logged)."""
    if compat.engines_fed(processor) > 1:
        return
    try:
        held = forms(entry)
        gone = registry.push_drops()
        compat.rpc(llm, rpc.VECTORS, [held.wire(entry.vid)], gone)
    except Exception as e:  # noqa: BLE001 - the vector still serves, by bytes
        logger.warning("inspect-lens: vector not pushed to the workers (requests carry its bytes): %s", e)
        return
    registry.pushed(gone)
    registry.held(entry, held)


async def push_async(engine_client: Any, processor: Any, registry: VectorRegistry, entry: Entry) -> None:
    """The same from the API server (`POST /v1/lens/vectors`)."""
    if compat.engines_fed(processor) > 1:
        return
    try:
        held = forms(entry)
        gone = registry.push_drops()
        await compat.rpc_async(engine_client, rpc.VECTORS, [held.wire(entry.vid)], gone)
    except Exception as e:  # noqa: BLE001 - the vector still serves, by bytes
        logger.warning("inspect-lens: vector not pushed to the workers (requests carry its bytes): %s", e)
        return
    registry.pushed(gone)
    registry.held(entry, held)


def by_reference(processor: Any, spec: RequestSpec, payload: dict[str, Any], used: list[Entry]) -> tuple[str, ...]:
    """Each steer of `payload` whose rows equal a held registration's, sent by reference (`{"ref": vid,
    "unit": ..., "repeat": n}` in place of the bytes, the payload marked: `VECTOR_REFS_KEY`); the registrations
    pinned for the request."""
    registry = engine_state(processor).vectors
    steers = payload.get("steer")
    if registry is None or not steers:
        return ()
    swaps: list[tuple[int, str, bool, int]] = []
    for j, s in enumerate(spec.steers):
        if s.digest is None:
            continue
        unit = s.op in (ABLATE, CAP)
        shape = tuple(s.vectors.shape)
        for e in used:
            h = e.held
            if h is None:
                continue
            repeat = shape[0] if len(h.shape) == 2 and h.shape[0] == 1 and shape[1:] == h.shape[1:] else 1
            if (repeat == 1 and shape != h.shape) or h.digest(unit, repeat) != s.digest:
                continue
            swaps.append((j, e.vid, unit, repeat))
            break
    vids = sorted({v for _, v, _, _ in swaps})
    if not swaps or not registry.pin(vids):
        return ()
    for j, vid, unit, repeat in swaps:
        steers[j]["vec"] = {"ref": vid, "unit": unit, "repeat": repeat}
    payload[VECTOR_REFS_KEY] = len(swaps)
    VECTOR_REFS["sent"] += len(swaps)
    return tuple(vids)


def drops(processor: Any) -> list[str]:
    registry = engine_state(processor).vectors
    out = [] if registry is None else registry.take_drops()
    VECTOR_REFS["drops_sent"] += len(out)
    return out
