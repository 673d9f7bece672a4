"""The `vllm.endpoint_plugins` entry (`inspect_lens_http`): what vLLM's OpenAI server calls to add our
routes and middleware, and to hand us its engine client."""

from __future__ import annotations

import os
from typing import Any

from vllm_worker import compat
from vllm_worker.frontend.state import mark_consumer
from vllm_worker.server.middleware import LensMiddleware
from vllm_worker.server.probes import router as probes_router
from vllm_worker.server.routes import info_router, router
from vllm_worker.server.saes import router as saes_router
from vllm_worker.server.state import LensState
from vllm_worker.server.vectors import vectors_router

# Seconds an idle keep-alive connection stays open, unless the operator set VLLM_HTTP_TIMEOUT_KEEP_ALIVE.
# vLLM's default (5 s) equals httpx's idle expiry (5 s, the OpenAI SDK's and our clients' transport): a
# client reusing a connection idle for ~5 s races the server's close and gets a reset
# (`httpx.ReadError`) for a request the server never read. A server timeout above the clients' own
# expiry (httpx 5 s, aiohttp 15 s, load balancers 60 s) lets the client always close first.
KEEP_ALIVE_S = "65"


def default_keep_alive() -> None:
    """Set vLLM's keep-alive timeout (read when its server starts, after the app is built)."""
    os.environ.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", KEEP_ALIVE_S)


class LensEndpoints:
    """The `vllm.endpoint_plugins` entry (`inspect_lens_http`); `vllm-lens serve` allow-lists it."""

    name = "inspect_lens_http"
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        default_keep_alive()
        app.include_router(router)
        app.include_router(info_router)
        app.include_router(vectors_router)
        app.include_router(saes_router)
        app.include_router(probes_router)
        app.add_middleware(LensMiddleware)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        state.lens = LensState(engine_client, keyed=bool(compat.api_keys(args)))
        if engine_client is not None:
            mark_consumer(compat.processor_of_engine_client(engine_client), "http")
