"""Probe scores in a streamed response: each SSE chunk that brings tokens also brings, per choice, the scores
of the positions scored since the previous chunk (`"probe_scores": {probe: {"positions", "scores"}}`) — the
positions whose forward passes produced its tokens, and on the first chunk the prompt's. The scores come
from `lens_probe_progress` RPCs shared by every stream (`probe_progress`), only for requests that asked for
probe scores; the full scores and aggregates still come in the extra chunk before `[DONE]`."""

from __future__ import annotations

from typing import Any

from vllm_worker import compat
from vllm_worker.frontend.state import pending_of
from vllm_worker.protocol.wire import tensor_from_bytes, to_jsonable
from vllm_worker.server.probe_progress import ProgressBatcher


class ProbeStream:
    """What a stream has sent of each choice's scores: the next position per (choice, probe)."""

    def __init__(self, engine: Any, progress: ProgressBatcher, kind: str, n: int) -> None:
        self.engine, self.progress, self.kind, self.n = engine, progress, kind, n
        self.next: dict[tuple[int, str], int] = {}
        self.wanted: dict[int, list[str]] = {}  # choice -> probes asked for (learnt on its first chunk)
        self.tokens: dict[int, int] = {}  # choice -> tokens streamed so far (this chunk's included)

    def _request(self, response_id: str, index: int) -> tuple[Any, int] | None:
        pending = pending_of(compat.processor_of_engine_client(self.engine))
        prompt = index // self.n if self.kind == "cmpl" else 0
        p = pending.get(compat.server_request_id(response_id, self.kind, prompt))
        if p is None or not p.probes:
            return None
        child = (index % self.n if self.kind == "cmpl" else index) if p.n > 1 else 0
        return p, child

    async def add_scores(self, response_id: str, chunk: dict) -> bool:
        """Put the new scores into `chunk`'s choices; whether it changed."""
        asks, where = [], {}
        where_end: dict[int, int] = {}  # choice -> first position past those that produced its tokens
        for c in chunk.get("choices") or []:
            if not c.get("token_ids"):
                continue
            got = self._request(response_id, c["index"])
            if got is None:
                continue
            p, child = got
            self.tokens[c["index"]] = self.tokens.get(c["index"], 0) + len(c["token_ids"])
            where_end[c["index"]] = p.prompt_len + self.tokens[c["index"]] - 1
            names = self.wanted.setdefault(c["index"], list(p.probes))
            start = min(self.next.get((c["index"], name), 0) for name in names)
            asks.append((p.key, child, start))
            where[(p.key, child)] = c
        if not asks:
            return False
        changed = False
        for key, child, got in await self.progress.ask(asks):
            c = where.get((key, int(child)))
            if c is None:
                continue
            out = c.setdefault("probe_scores", {})
            for name, item in got.items():
                pos = tensor_from_bytes(item["positions"], f"probe_scores.{name}.positions")
                at = self.next.get((c["index"], name), 0)
                # the workers may be a step ahead of the stream: only the positions of its tokens
                keep = (pos >= at) & (pos < where_end[c["index"]])
                if not bool(keep.any()):
                    continue
                scores = tensor_from_bytes(item["scores"], f"probe_scores.{name}")[keep]
                out[name] = {"positions": to_jsonable(pos[keep]), "scores": to_jsonable(scores)}
                self.next[(c["index"], name)] = int(pos[keep].max()) + 1
                changed = True
        return changed
