"""`/v1/lens/vectors`: named vectors on the server (`frontend.vectors`), so steering requests carry a
name instead of the tensor.

    POST   /v1/lens/vectors          {"name": "happy", "activations": <tensor object>}  register / replace
    GET    /v1/lens/vectors          {"vectors": [{"name", "shape", "dtype", "bytes"}], "bytes", "limit_bytes"}
    DELETE /v1/lens/vectors/{name}   404 naming it when unknown

On a server started with `--api-key`, each key sees only the vectors registered with it."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from vllm_worker import compat, envs
from vllm_worker.frontend import vector_refs
from vllm_worker.frontend.vectors import LIMIT, SCOPE_KEY, check_name, check_vector, registry_of, scope_token
from vllm_worker.protocol.spec import STEER_KEY, max_payload_bytes
from vllm_worker.protocol.wire import tensor_from_json
from vllm_worker.server.responses import BadRequest
from vllm_worker.server.routes import caller_input, guard, json_body
from vllm_worker.server.state import LensState, shape_of, state_of

VECTORS_PATH = "/v1/lens/vectors"

vectors_router = APIRouter(prefix=VECTORS_PATH)


def bearer(headers: Any) -> str | None:
    """The API key a request presents (`Authorization: Bearer <key>`, what vLLM's auth checks); `headers`:
    an ASGI scope's raw header pairs or a Starlette `Headers`."""
    if hasattr(headers, "get"):
        value = headers.get("authorization")
    else:
        value = next((v.decode("latin-1") for k, v in headers if k.lower() == b"authorization"), None)
    if not value:
        return None
    scheme, _, key = value.partition(" ")
    return key if scheme.lower() == "bearer" else None


def scope_for(state: LensState, headers: Any) -> str:
    """The request's scope: its key's on a server with keys (vLLM has already refused wrong keys under
    /v1), else the one shared scope."""
    return scope_token(bearer(headers)) if state.keyed else ""


def stamp_scope(state: LensState, xargs: dict, headers: Any) -> None:
    """On a generation request's `vllm_xargs` (middleware): drop any scope a caller sent and, when it
    steers, set its own."""
    xargs.pop(SCOPE_KEY, None)
    if STEER_KEY in xargs:
        scope = scope_for(state, headers)
        if scope:
            xargs[SCOPE_KEY] = scope


def _registry(state: LensState):
    return registry_of(compat.processor_of_engine_client(state.engine))


@vectors_router.post("")
@guard
async def register(request: Request):
    state = state_of(request.app)
    body = await json_body(request, frozenset({"name", "activations"}))
    with caller_input():
        name = check_name(body.get("name"), "name")
    obj = body.get("activations")
    if not isinstance(obj, dict):
        raise BadRequest(400, "activations: expected a tensor object {dtype, shape, b64}", "activations")
    shape = shape_of(state)

    def decode():
        return check_vector(tensor_from_json(obj, "activations", max_bytes=max_payload_bytes()), shape, "activations")

    with caller_input():  # (the registry's refusal past VLLM_LENS_MAX_VECTORS_MB too)
        vec = await asyncio.to_thread(decode)  # base64 of up to VLLM_LENS_MAX_PAYLOAD_MB: off the event loop
        scope = scope_for(state, request.headers)
        registry = _registry(state)
        info = registry.register(scope, name, vec)
    entry = registry.entry(scope, name, "name")
    await vector_refs.push_async(state.engine, compat.processor_of_engine_client(state.engine), registry, entry)
    return {"status": "ok", **info}


@vectors_router.get("")
@guard
async def list_vectors(request: Request):
    state = state_of(request.app)
    vectors = _registry(state).list(scope_for(state, request.headers))
    return {"vectors": vectors, "bytes": sum(v["bytes"] for v in vectors), "limit_bytes": envs.limit(LIMIT)}


@vectors_router.delete("/{name}")
@guard
async def delete(request: Request):
    state = state_of(request.app)
    name = request.path_params["name"]
    if not _registry(state).delete(scope_for(state, request.headers), name):
        raise BadRequest(404, f"name: no vector named {name[:128]!r} is registered", "name")
    return {"status": "ok", "deleted": name}
