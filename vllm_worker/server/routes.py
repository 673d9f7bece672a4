"""Our routes: `/v1/hooks/*` (persistent hooks: register, collect, clear; parameter prefetch) and
`GET /v1/lens/info` (model shape, limits in force, what is in flight). Hooks are code: refused (403)
unless the server was started with `--allow-remote-hooks`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Iterator

from fastapi import APIRouter, Request

from vllm_worker import compat, counters, envs
from vllm_worker.frontend.fetch import merge_collected, release_results_async
from vllm_worker.frontend.requests import in_flight_bytes, pending_count
from vllm_worker.frontend.validation import parse_hooks
from vllm_worker.protocol import errors, rpc
from vllm_worker.protocol.points import POINTS
from vllm_worker.protocol.spec import (
    HOOK_KEY,
    remote_hooks_allowed,
    require_remote_hooks,
)
from vllm_worker.protocol.wire import to_jsonable, to_original_jsonable
from vllm_worker.server.choices import mentions
from vllm_worker.server.responses import BadRequest, error_response, max_body_bytes
from vllm_worker.server.state import LensState, shape_of, state_of

HOOKS_PREFIX = "/v1/hooks"

logger = logging.getLogger("vllm_worker")


router = APIRouter(prefix=HOOKS_PREFIX)


async def json_body(request: Request, fields: frozenset[str] | None = None) -> dict:
    """The body as a JSON object, bounded; with `fields`, any other key is a 400 naming it."""
    raw = await request.body()
    if len(raw) > max_body_bytes():
        raise BadRequest(
            413, f"request body exceeds the limit of {max_body_bytes()} bytes (VLLM_LENS_MAX_PAYLOAD_MB)", "body"
        )
    if not raw:
        return {}
    try:
        obj = json.loads(raw)
    except ValueError:
        raise BadRequest(400, "request body is not valid JSON", "body") from None
    if not isinstance(obj, dict):
        raise BadRequest(400, "request body must be a JSON object", "body")
    unknown = sorted(set(obj) - fields) if fields is not None else []
    if unknown:
        raise BadRequest(400, f"unknown fields {unknown} (fields: {', '.join(sorted(fields or ()))})", unknown[0])
    return obj


def guard(fn):
    """The route's failures as JSON: the caller's (by class: `BadRequest`, `errors.CallerError`, a refused
    opt-in) a 4xx naming the field; anything else is our own failure, a 500 (logged) — never a 400 because
    of an exception's class or wording that our code happens to share with validation."""
    import functools

    @functools.wraps(fn)
    async def wrapper(request: Request):
        try:
            return await fn(request)
        except BadRequest as e:
            return error_response(e.status, e.message, e.param)
        except errors.CallerError as e:
            return error_response(e.status, str(e), e.param)
        except PermissionError as e:
            return error_response(403, str(e), "hooks", "Forbidden")
        except Exception as e:  # noqa: BLE001 - ours: a 500, the server goes on
            logger.exception("inspect-lens: %s %s failed", request.method, request.url.path)
            return error_response(
                500, f"inspect-lens internal error: {type(e).__name__}: {e}", None, "InternalServerError"
            )

    return wrapper


@contextlib.contextmanager
def caller_input() -> Iterator[None]:
    """Around a check of the caller's input only: our validators raise ValueError naming the field
    (`field: why`), so one from inside is the caller's (a 400 naming it). Everywhere else a ValueError is
    ours (`guard`: a 500)."""
    try:
        yield
    except ValueError as e:
        msg = str(e).strip("'\"")
        raise BadRequest(400, msg, msg.split(":", 1)[0] if ":" in msg else None) from None


def param_names(obj: dict, key: str) -> list[str]:
    names = obj.get(key) or []
    if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
        raise BadRequest(400, f"{key}: expected a list of parameter names", key)
    return names


@router.post("/register")
@guard
async def register(request: Request):
    state = state_of(request.app)
    require_remote_hooks("hooks")
    body = await json_body(request, frozenset({"hooks", "prefetch_params"}))
    hooks = body.get("hooks")
    if not isinstance(hooks, list) or not hooks:
        raise BadRequest(400, "hooks: expected a non-empty list", "hooks")
    try:
        specs = parse_hooks(hooks, shape_of(state))
    except ValueError as e:  # name the field of this body (`hooks[0].fn`), not the generation key's
        msg = str(e)
        msg = "hooks" + msg[len(HOOK_KEY) :] if msg.startswith(HOOK_KEY) else msg
        raise BadRequest(400, msg, msg.split(":", 1)[0]) from None
    names = param_names(body, "prefetch_params")
    if names:
        await prefetch_names(state, names, "prefetch_params")
    counts = await compat.rpc_async(state.engine, rpc.REGISTER_HOOKS, [h.rpc() for h in specs])
    state.persistent_hooks = True
    state.original_collect = mentions(hooks, '"cloudpickle"')
    return {"status": "ok", "registered": counts[0], "count": counts[0]}


@router.post("/collect")
@guard
async def collect(request: Request):
    state = state_of(request.app)
    results = merge_collected(await compat.rpc_async(state.engine, rpc.COLLECT_HOOK_RESULTS))
    encode = to_original_jsonable if state.original_collect else to_jsonable
    return {"status": "ok", "results": await asyncio.to_thread(encode, results), "count": len(results)}


@router.post("/clear")
@guard
async def clear(request: Request):
    state = state_of(request.app)
    await compat.rpc_async(state.engine, rpc.CLEAR_HOOKS)
    state.persistent_hooks = state.original_collect = False
    return {"status": "ok", "cleared": True}


@router.post("/clear_results")
@guard
async def clear_results(request: Request):
    await compat.rpc_async(state_of(request.app).engine, rpc.CLEAR_HOOK_RESULTS)
    return {"status": "ok", "cleared": True}


@router.post("/prefetch")
@guard
async def prefetch(request: Request):
    names = param_names(await json_body(request), "names")
    done = await prefetch_names(state_of(request.app), names, "names")
    return {"status": "ok", "prefetched": done, "count": len(done)}


async def prefetch_names(state: LensState, names: list[str], param: str) -> list[str]:
    """An unknown parameter comes back from the workers as a failure of the caller's kind (`report`):
    a 400 naming `param`; anything else they raise is ours (a 500)."""
    answers = await compat.rpc_async(state.engine, rpc.PREFETCH, names, True)
    for a in answers:
        if a.get("error") is not None:
            f = a["error"]
            raise errors.CallerError(errors.failure(f["kind"], f"{param}: {f['message']}", f["stage"]), param)
    return answers[0]["prefetched"]


@router.post("/clear_prefetched")
@guard
async def clear_prefetched(request: Request):
    await compat.rpc_async(state_of(request.app).engine, rpc.CLEAR_PREFETCHED)
    return {"status": "ok", "cleared": True}


info_router = APIRouter(prefix="/v1/lens")


WORKER_COUNTS = (
    "request_states",
    "steering_entries",
    "steering_shared_chains",
    "probe_score_chunks",
    "action_slots",
    "action_requests",
    "action_stops",
)
WORKER_TOTALS = ("steer_table_full",)


@info_router.get("/info")
@guard
async def info(request: Request):
    import vllm

    state = state_of(request.app)
    shape = shape_of(state)
    await release_results_async(state.engine)  # what responses already sent no longer hold
    status = await compat.rpc_async(state.engine, rpc.STATUS)
    return {
        "n_layers": shape.n_layers,
        "d_model": shape.d_model,
        "d_mlp": shape.d_mlp,  # mlp_post's width (0: unknown)
        # hook points requests may name (docs/hook-points.md), and why the others are missing
        "points": [p for p in POINTS if p not in shape.missing],
        "missing_points": shape.missing,
        "vllm_version": vllm.__version__,
        "engines": compat.engine_count(state.engine),  # data-parallel engine cores this API server feeds
        "remote_hooks": remote_hooks_allowed(),
        # results waiting for a consumer: both return to 0 once requests finish or are aborted
        "pending_results": pending_count(compat.processor_of_engine_client(state.engine)),
        "stored_requests": sum(st["stored_requests"] for st in status),
        # shared-memory result regions handed out and not yet given back (0 once responses are sent)
        "result_regions": sum(st.get("result_regions", 0) for st in status),
        # captures admitted and not yet returned, at their largest (counted against VLLM_LENS_MAX_STORED_GB)
        "capture_bytes_in_flight": in_flight_bytes(compat.processor_of_engine_client(state.engine)),
        # what the workers keep per running request (request states, steering entries and the chains they
        # share, probe scores, probe actions' slots): 0 once requests leave — a worker sees a request leave
        # at its next step; and what they counted since start (requests that found the steering table full
        # and took the Python path: raise VLLM_LENS_STEER_MB)
        **{k: sum(st.get(k, 0) for st in status) for k in WORKER_COUNTS + WORKER_TOTALS},
        "limits": envs.limits(),
        # streaming with probe scores: progress RPCs sent and the chunks they served (one RPC serves many)
        "stream_progress": dict(counters.STREAM_PROGRESS),
        # responses' result fetches and the batches they shared round trips in (one batch serves many)
        "fetch_batches": dict(counters.FETCH_BATCHES),
        # what a probe score depends on besides the probe (dtype, quantization, TP/PP, versions, model)
        "provenance": compat.serving_provenance(compat.processor_of_engine_client(state.engine)),
    }
