"""Callers' asks gathered into one round trip to the engine at a time. Each RPC is handled by the engine
core between steps, so one per caller would queue them behind each other: asks of the same event-loop tick,
and those arriving while a round trip is in flight, go together in the next one. Each caller gets its own
answer; a failure of the round trip is every waiting caller's."""

from __future__ import annotations

import asyncio
from typing import Any, Generic, TypeVar

Ask = TypeVar("Ask")


class RoundTrips(Generic[Ask]):
    """`serve(asks)` answers one round trip's asks, one answer each, in order; `after_round()` runs between
    round trips (a pause, say)."""

    def __init__(self) -> None:
        self._queue: list[tuple[Ask, asyncio.Future]] = []
        self._draining = False
        self._task: asyncio.Task | None = None  # held: the loop keeps only a weak reference to a task

    async def submit(self, ask: Ask) -> Any:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue.append((ask, fut))
        if not self._draining:
            self._draining = True
            self._task = asyncio.get_running_loop().create_task(self._drain())
        return await fut

    async def serve(self, asks: list[Ask]) -> list[Any]:
        raise NotImplementedError

    async def after_round(self) -> None:
        return None

    async def _drain(self) -> None:
        try:
            while self._queue:
                await asyncio.sleep(0)  # the other callers of this tick join this round trip
                batch, self._queue = self._queue, []
                try:
                    answers = await self.serve([ask for ask, _ in batch])
                except Exception as e:  # noqa: BLE001 - each waiting caller handles it as its own failure
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(e)
                else:
                    for (_, fut), answer in zip(batch, answers):
                        if not fut.done():  # (a caller cancelled meanwhile: its answer is dropped)
                            fut.set_result(answer)
                await self.after_round()
        finally:
            self._draining = False
