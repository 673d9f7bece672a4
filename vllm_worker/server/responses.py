"""JSON answers of the HTTP layer: error bodies in OpenAI's shape (with the offending field), request
bodies bounded while they arrive, and large responses encoded and sent in pieces off the event loop."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi.responses import JSONResponse

from vllm_worker.protocol.spec import max_payload_bytes
from vllm_worker.protocol.wire import json_chunks


def max_body_bytes() -> int:
    """A request body's cap: the payload cap plus room for the rest of the request."""
    return max_payload_bytes() + (1 << 20)


logger = logging.getLogger("vllm_worker")


def error_body(status: int, message: str, param: str | None, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None, kind: str = "BadRequestError") -> JSONResponse:
    return JSONResponse(error_body(status, message, param, kind), status_code=status)


async def read_body(receive: Any, scope: dict, limit: int) -> bytes | None:
    """The request body, or None as soon as it is known to exceed `limit` (a declared Content-Length,
    or the bytes received so far): a huge body is refused while it arrives, never held whole."""
    for k, v in scope.get("headers", ()):
        if k.lower() == b"content-length":
            try:
                if int(v) > limit:
                    return None
            except ValueError:
                pass
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            break
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not msg.get("more_body"):
            break
    return b"".join(chunks)


async def too_large(send: Any) -> None:
    await send_json(
        send,
        413,
        error_body(
            413,
            f"request body exceeds the limit of {max_body_bytes()} bytes (VLLM_LENS_MAX_PAYLOAD_MB)",
            "body",
            "PayloadTooLargeError",
        ),
    )


def replay(body: bytes, receive: Any):
    """Hand the (possibly rewritten) body to the app once; afterwards wait on the real channel, so
    vLLM's disconnect watcher sees a real disconnect, not an invented one."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


SEND_CHUNK = 16 << 20  # bytes per ASGI body message: the transport's flow control paces large answers


async def dumps(obj: Any) -> list[bytes]:
    """JSON of a response as pieces; encoded in a thread, piece by piece (`json_chunks`), so a GiB-sized
    capture never holds the event loop (health checks, other requests' streams) for long."""
    return await asyncio.to_thread(json_chunks, obj)


async def send_json(send: Any, status: int, obj: Any, headers: list | None = None) -> None:
    pieces = await dumps(obj)
    hdrs = [(k, v) for k, v in (headers or []) if k.lower() not in (b"content-length", b"content-type")]
    hdrs += [(b"content-type", b"application/json"), (b"content-length", str(sum(len(p) for p in pieces)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    batch: list[bytes] = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece)
        if size >= SEND_CHUNK:
            await send({"type": "http.response.body", "body": b"".join(batch), "more_body": True})
            batch, size = [], 0
    await send({"type": "http.response.body", "body": b"".join(batch)})
    batch = []  # no reference left here: the pieces are freed in release's thread, not on return
    await release(pieces)


async def release(*objs: Any) -> None:
    """Drop a large answer's last references in a thread: freeing a GiB (unmapping shared-memory captures,
    a million small objects) would otherwise hold the event loop for a third of a second. Runs after the
    answer is complete, so it never raises: uvicorn closes the connection of an app that raises then, and
    a keep-alive client may already have sent its next request on it (it would get a reset)."""

    def clear() -> None:
        for o in objs:
            o.clear()

    try:
        await asyncio.to_thread(clear)
    except Exception:  # noqa: BLE001
        logger.exception("inspect-lens: releasing a sent answer failed")


class BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None) -> None:
        self.status, self.message, self.param = status, message, param
