"""One `lens_probe_progress` RPC serves every streaming request at once. Each RPC is handled by the engine
core between steps, so one RPC per chunk would cost the engine a round trip per stream per step; here the
chunks that arrive while an RPC is in flight (and those of the same event-loop tick) wait for the next one,
which asks for all of them. An RPC's cost in the engine grows with the streaming requests (each one's scores
cut and encoded), so back-to-back RPCs would still stall generation much of the time: after each one the
next waits `VLLM_LENS_STREAM_PACE` times its round trip (at most `VLLM_LENS_STREAM_MAX_PAUSE_MS`). The chunks
that wait lose nothing: the engine merges a stream's outputs until the stream takes them, and the next RPC
brings all their rows. A stream's last chunk ends the wait: it is all that holds the stream open."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from vllm_worker import compat, counters, envs
from vllm_worker.frontend.round_trips import RoundTrips
from vllm_worker.protocol import rpc

Ask = tuple[str, int, int]  # (request key, child, first position wanted)


class ProgressBatcher(RoundTrips[list[Ask]]):
    """Gathers the asks of every stream of one engine client into one RPC at a time (`round_trips`),
    paced as the module says."""

    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.engine = engine
        self._wake: asyncio.Event | None = None  # set by a last chunk's ask: the pause ends at once
        self._hurry = False  # a last chunk's ask is queued: no pause before the next RPC
        self._took = 0.0  # the last RPC's round trip

    async def ask(self, asks: list[Ask], last: bool = False) -> list[list]:
        """[key, child, payload] for these asks, from every worker that scores them. `last`: a stream's final
        chunk, sent with the next RPC without waiting for the pause."""
        if last:
            self._hurry = True
            if self._wake is not None:
                self._wake.set()
        return await self.submit(asks)

    async def serve(self, batch: list[list[Ask]]) -> list[list[list]]:
        self._hurry = False  # (the asks queued so far, a last chunk's among them, go in this RPC)
        t0 = time.perf_counter()
        try:
            return await self._one_rpc(batch)
        finally:
            self._took = time.perf_counter() - t0
            counters.STREAM_PROGRESS["rpc_s"] += self._took

    async def after_round(self) -> None:
        await self._pause(pause_after(self._took))

    async def _pause(self, seconds: float) -> None:
        """Wait `seconds`, or until a stream's last chunk asks; the time waited is counted."""
        if self._hurry:
            return
        t0 = time.perf_counter()
        self._wake = asyncio.Event()
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except asyncio.TimeoutError:  # (not the builtin before Python 3.11)
            pass
        finally:
            self._wake = None
            counters.STREAM_PROGRESS["pause_s"] += time.perf_counter() - t0

    async def _one_rpc(self, batch: list[list[Ask]]) -> list[list[list]]:
        first: dict[tuple[str, int], int] = {}
        for asks in batch:
            for key, child, start in asks:
                first[(key, child)] = min(start, first.get((key, child), start))
        counters.STREAM_PROGRESS["rpcs"] += 1
        counters.STREAM_PROGRESS["asks"] += sum(len(a) for a in batch)
        answers = await compat.rpc_async(self.engine, rpc.PROBE_PROGRESS, [(k, c, s) for (k, c), s in first.items()])
        by_request: dict[tuple[str, int], list[list]] = {}
        for answer in answers:
            for key, child, payload in answer or ():
                by_request.setdefault((key, int(child)), []).append([key, int(child), payload])
        return [[got for key, child, _ in asks for got in by_request.get((key, child), ())] for asks in batch]


def pause_after(took: float) -> float:
    """Seconds to wait after an RPC that took `took` seconds before the next one."""
    cap = envs.get("VLLM_LENS_STREAM_MAX_PAUSE_MS") / 1000.0
    return max(0.0, min(envs.get("VLLM_LENS_STREAM_PACE") * took, cap))


def batcher_of(state: Any) -> ProgressBatcher:
    """The server's batcher (one per engine client)."""
    if state.progress is None:
        state.progress = ProgressBatcher(state.engine)
    return state.progress
