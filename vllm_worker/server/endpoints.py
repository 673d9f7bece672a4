"""The `vllm.endpoint_plugins` entry (`inspect_lens_http`): what vLLM's OpenAI server calls to add our
routes and middleware, and to hand us its engine client."""

from __future__ import annotations

from typing import Any

from vllm_worker import compat
from vllm_worker.frontend.requests import mark_consumer
from vllm_worker.server.middleware import LensMiddleware
from vllm_worker.server.routes import info_router, router
from vllm_worker.server.saes import router as saes_router
from vllm_worker.server.state import LensState
from vllm_worker.server.vectors import vectors_router


class LensEndpoints:
    """The `vllm.endpoint_plugins` entry (`inspect_lens_http`); `vllm-lens serve` allow-lists it."""

    name = "inspect_lens_http"
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        app.include_router(router)
        app.include_router(info_router)
        app.include_router(vectors_router)
        app.include_router(saes_router)
        app.add_middleware(LensMiddleware)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        state.lens = LensState(engine_client, keyed=bool(compat.api_keys(args)))
        if engine_client is not None:
            mark_consumer(compat.processor_of_engine_client(engine_client), "http")
