"""Streaming responses: SSE events pass through unchanged (a request asking for probe scores gets the new
scores in each chunk: `probe_stream`); one extra chunk with every choice's results goes out just before
`data: [DONE]`."""

from __future__ import annotations

import json
import logging
from typing import Any

from vllm_worker.server.choices import Choice, Unmatched, fetch_results, hook_failure
from vllm_worker.server.probe_progress import batcher_of
from vllm_worker.server.probe_stream import ProbeStream
from vllm_worker.server.responses import dumps, error_body
from vllm_worker.server.state import LensState

logger = logging.getLogger("vllm_worker")


class StreamInjector:
    """Passes SSE events through, remembers token ids per choice, and adds one chunk with the
    activations and hook results of every choice just before `data: [DONE]`."""

    def __init__(self, send: Any, state: LensState, kind: str, n: int, expect: bool) -> None:
        self._send, self.state, self.kind, self.n, self.expect = send, state, kind, n, expect
        self.buf = b""
        self.response_id: str | None = None
        self.obj: str | None = None
        self.choices: dict[int, Choice] = {}
        self.probes = ProbeStream(state.engine, batcher_of(state), kind, n) if expect else None

    def _observe(self, event: bytes) -> dict | None:
        if not event.startswith(b"data: ") or event.startswith(b"data: [DONE]"):
            return None
        try:
            chunk = json.loads(event[6:])
        except ValueError:
            return None
        self.response_id = self.response_id or chunk.get("id")
        self.obj = self.obj or chunk.get("object")
        top_prompt = chunk.get("prompt_token_ids")
        for c in chunk.get("choices") or []:
            st = self.choices.setdefault(c["index"], Choice(c["index"]))
            st.prompt_ids = st.prompt_ids or c.get("prompt_token_ids") or top_prompt or []
            st.token_ids.extend(c.get("token_ids") or [])
        return chunk

    async def send(self, msg: dict) -> None:
        if msg["type"] != "http.response.body":
            return await self._send(msg)
        self.buf += msg.get("body", b"")
        out = b""
        while b"\n\n" in self.buf:
            event, self.buf = self.buf.split(b"\n\n", 1)
            if event.startswith(b"data: [DONE]"):
                out += await self._final_event()
            else:
                chunk = self._observe(event)
                if chunk is not None and self.probes is not None and self.response_id is not None:
                    event = await self._with_scores(chunk, event)
            out += event + b"\n\n"
        if out or not msg.get("more_body", False):
            await self._send(
                {
                    "type": "http.response.body",
                    "body": out + (b"" if msg.get("more_body") else self.buf),
                    "more_body": msg.get("more_body", False),
                }
            )

    async def _with_scores(self, chunk: dict, event: bytes) -> bytes:
        """The event with the new probe scores of its choices. A failure of ours here stops the per-chunk
        scores of this stream (said in the chunk, logged); the full scores still come before `[DONE]`."""
        assert self.probes is not None and self.response_id is not None
        try:
            if not await self.probes.add_scores(self.response_id, chunk):
                return event
        except Exception as e:  # noqa: BLE001 - the stream goes on; its final chunk has every score
            logger.error("inspect-lens: per-chunk probe scores failed: %s: %s", type(e).__name__, e)
            self.probes = None
            for c in chunk.get("choices") or []:
                c["probe_scores_error"] = f"inspect-lens internal error: {type(e).__name__}: {e}"
        return b"data: " + json.dumps(chunk).encode()

    async def _final_event(self) -> bytes:
        if self.response_id is None:
            return b""
        try:
            extra, errors = await fetch_results(
                self.state,
                self.kind,
                self.response_id,
                self.n,
                [self.choices[i] for i in sorted(self.choices)],
                self.expect,
            )
        except Unmatched as e:
            return b"data: " + json.dumps(error_body(500, str(e), None, "InternalServerError")).encode() + b"\n\n"
        if errors:
            return b"data: " + json.dumps(hook_failure(errors)).encode() + b"\n\n"
        extra = {i: e for i, e in extra.items() if e}  # steering-only choices have nothing to add
        if not extra:
            return b""
        chunk = {
            "id": self.response_id,
            "object": self.obj,
            "choices": [dict(index=i, **extra[i]) for i in sorted(extra)],
        }
        return b"data: " + b"".join(await dumps(chunk)) + b"\n\n"
