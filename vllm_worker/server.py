"""HTTP surface: an endpoint plugin for vLLM's OpenAI server (`vllm.endpoint_plugins`).

- `/v1/completions` and `/v1/chat/completions` accept our keys in `vllm_xargs`; every choice of the
  response carries `activations` / `hook_results` (streaming: one extra chunk before `[DONE]`). The
  response also carries `prompt_token_ids` / `token_ids`, which align positions with tokens.
- `/v1/hooks/*` manage persistent hooks; `GET /v1/lens/info` reports the model's shape (n_layers, d_model)
  so clients can pick layers (e.g. the middle one) without loading the model themselves.
- Hooks are code: they are refused (403) unless the server was started with `--allow-remote-hooks`.
  Captures and steering never need it, and nothing received from a client is unpickled otherwise.
- Bad input is a 4xx JSON error naming the field; vLLM's `--api-key` guards these routes too.
- A request written for the original vllm-lens (`original_dialect`) is answered in its form: results of
  the first choice at the top level of the response (`activations`, `hook_results`), tensors as its
  zstd tensor objects — so its own client reads them; nothing is sent twice.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from . import adapter
from .frontend import (Pending, _pending, decode_sample, fetch_async, in_flight_bytes, mark_consumer, merge_collected,
                       pending_count, release_results_async)
from .limits import LIMITS, limit
from .spec import (ALL_LAYERS, CAPTURE_KEY, HOOK_KEY, MAX_PAYLOAD_BYTES, STEER_KEY, ModelShape, capture_layers,
                   has_lens_keys, parse_hooks, remote_hooks_allowed)
from .wire import json_chunks, tensor_to_original_json, to_jsonable, to_original_jsonable

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MAX_BODY_BYTES = MAX_PAYLOAD_BYTES + (1 << 20)


def error_body(status: int, message: str, param: str | None, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _error(status: int, message: str, param: str | None = None, kind: str = "BadRequestError") -> JSONResponse:
    return JSONResponse(error_body(status, message, param, kind), status_code=status)


@dataclass
class LensState:
    engine: Any
    persistent_hooks: bool = False
    shape: ModelShape | None = field(default=None)
    original_collect: bool = False  # the persistent hooks came in the original's form: collect answers in it


def _mentions(value: Any, marker: str) -> bool:
    return marker in (value if isinstance(value, str) else json.dumps(value, default=str))


def original_dialect(xargs: dict) -> bool:
    """The request was written for the original vllm-lens: its client sends the layer list as a JSON
    string and its own tensor objects (`original_dtype`) and hook objects (`{"fn": {"cloudpickle": ...}}`).
    Our client and docs send a list, `b64` tensor objects and `{"fn": base64}` hooks."""
    if isinstance(xargs.get(CAPTURE_KEY), str):
        return True
    return (STEER_KEY in xargs and _mentions(xargs[STEER_KEY], '"original_dtype"')) or \
        (HOOK_KEY in xargs and _mentions(xargs[HOOK_KEY], '"cloudpickle"'))


def _state(app: Any) -> LensState:
    return app.state.lens


# ---------------------------------------------------------------- results for one response


@dataclass
class _Choice:
    index: int
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


class _Unmatched(RuntimeError):
    """The response's ids do not lead to our pending requests: fail loudly, never drop results."""


async def _results(state: LensState, kind: str, response_id: str, n: int, choices: list[_Choice],
                   expect: bool, dialect: bool = False) -> tuple[dict[int, dict], dict[str, str]]:
    """({choice index: {"activations": ..., "hook_results": ...}}, {request id: error})."""
    pending = _pending(adapter.processor_of_engine_client(state.engine))
    by_request: dict[str, list[tuple[_Choice, int]]] = {}
    for c in choices:
        rid = adapter.server_request_id(response_id, kind, c.index // n if kind == "cmpl" else 0)
        child = c.index % n if kind == "cmpl" else c.index
        by_request.setdefault(rid, []).append((c, child))
    todo = []
    for rid, items in by_request.items():
        p: Pending | None = pending.pop(rid, None)
        if p is not None:
            todo.append((rid, p, {(ch if p.n > 1 else 0): len(c.prompt_ids) + len(c.token_ids) - 1
                                  for c, ch in items}))
        elif expect:
            raise _Unmatched(f"inspect-lens: no pending results for engine request {rid!r} of response "
                             f"{response_id!r} (did vLLM change its request-id format?)")
    merged = await fetch_async(state.engine, [(p, ch) for _, p, ch in todo])
    # decoding and JSON conversion of large captures run in a worker thread: the event loop (health
    # checks, other requests' streams) keeps answering meanwhile
    out, errors = await asyncio.to_thread(_decode_results, todo, by_request, merged, dialect)
    if state.persistent_hooks:
        for rank_errors in await adapter.rpc_async(state.engine, "lens_pop_persistent_errors", list(by_request)):
            errors.update(rank_errors or {})
    return out, errors


def _decode_results(todo: list, by_request: dict, merged: dict,
                    dialect: bool = False) -> tuple[dict[int, dict], dict[str, str]]:
    """`dialect`: the original vllm-lens's forms (see `original_dialect`)."""
    out: dict[int, dict] = {}
    errors: dict[str, str] = {}
    for rid, p, _ in todo:
        for c, child in by_request[rid]:
            acts, hooks, err = decode_sample(p, merged.get(p.key, {}), child if p.n > 1 else 0)
            if err is not None:
                errors[rid if p.n == 1 else f"{rid}#{child}"] = err
                continue
            entry: dict[str, Any] = {}
            if acts is not None:
                if dialect:  # its decode_activations passes {"__json__": ...} entries through
                    entry["activations"] = {"residual_stream": tensor_to_original_json(acts["residual_stream"]),
                                            "layers": {"__json__": acts["layers"]}}
                else:
                    entry["activations"] = {"residual_stream": to_jsonable(acts["residual_stream"], lazy=True),
                                            "layers": acts["layers"]}
            if hooks is not None:
                entry["hook_results"] = to_original_jsonable(hooks) if dialect else to_jsonable(hooks, lazy=True)
            out[c.index] = entry
    return out, errors


def _internal(errors: dict[str, str]) -> bool:
    """Failures of our own code (not of the user's hook): a 500, not a 400."""
    return all("inspect-lens internal error" in m for m in errors.values())


def _hook_failure(errors: dict[str, str]) -> dict:
    if _internal(errors):
        msg = "inspect-lens request failed\n" + "\n".join(f"request {r}: {m}" for r, m in errors.items())
        return error_body(500, msg, None, "InternalServerError")
    msg = "inspect-lens hook failed\n" + "\n".join(f"request {r}: {m}" for r, m in errors.items())
    return error_body(400, msg, f"vllm_xargs.{HOOK_KEY}", "HookError")


# ---------------------------------------------------------------- middleware


async def _read_body(receive: Any, scope: dict, limit: int) -> bytes | None:
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


async def _too_large(send: Any) -> None:
    await _send_json(send, 413, error_body(
        413, f"request body exceeds the limit of {MAX_BODY_BYTES} bytes (VLLM_LENS_MAX_PAYLOAD_MB)",
        "body", "PayloadTooLargeError"))


def _replay(body: bytes, receive: Any):
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


_SEND_CHUNK = 16 << 20  # bytes per ASGI body message: the transport's flow control paces large answers


async def _dumps(obj: Any) -> list[bytes]:
    """JSON of a response as pieces; encoded in a thread, piece by piece (`json_chunks`), so a GiB-sized
    capture never holds the event loop (health checks, other requests' streams) for long."""
    return await asyncio.to_thread(json_chunks, obj)


async def _send_json(send: Any, status: int, obj: Any, headers: list | None = None) -> None:
    pieces = await _dumps(obj)
    hdrs = [(k, v) for k, v in (headers or []) if k.lower() not in (b"content-length", b"content-type")]
    hdrs += [(b"content-type", b"application/json"),
             (b"content-length", str(sum(len(p) for p in pieces)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    batch: list[bytes] = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece)
        if size >= _SEND_CHUNK:
            await send({"type": "http.response.body", "body": b"".join(batch), "more_body": True})
            batch, size = [], 0
    await send({"type": "http.response.body", "body": b"".join(batch)})
    batch = []  # no reference left here: the pieces are freed in _release's thread, not on return
    await _release(pieces)


async def _release(*objs: Any) -> None:
    """Drop a large answer's last references in a thread: freeing a GiB (unmapping shared-memory captures,
    a million small objects) would otherwise hold the event loop for a third of a second."""
    def clear() -> None:
        for o in objs:
            o.clear()

    await asyncio.to_thread(clear)


def _precheck(req: dict, xargs: dict, shape: ModelShape) -> None:
    """Checks that must see the raw JSON: vLLM turns JSON booleans in `vllm_xargs` into ints (`true` would
    become layer 1) and some malformed fields would otherwise surface as empty 500s."""
    n = req.get("n", 1)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise _BadRequest(400, f"n: expected a positive integer, got {str(n)[:40]!r}", "n")
    if req.get("use_beam_search"):
        raise _BadRequest(400, "use_beam_search: capture, steering and hooks are not supported with beam search",
                          "use_beam_search")
    if CAPTURE_KEY in xargs:
        value = xargs[CAPTURE_KEY]
        if value is True:
            xargs[CAPTURE_KEY] = ALL_LAYERS  # the original tool's "every layer", kept a string for vLLM
            return
        try:
            capture_layers(value, shape.n_layers)
        except ValueError as e:
            raise _BadRequest(400, str(e), f"vllm_xargs.{CAPTURE_KEY}") from None


class LensMiddleware:
    """Pure ASGI (streaming-safe) middleware on the two generation routes."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        if path.startswith(HOOKS_PREFIX + "/"):  # our routes: bounded while reading, like generation
            body = await _read_body(receive, scope, MAX_BODY_BYTES)
            if body is None:
                return await _too_large(send)
            return await self.app(scope, _replay(body, receive), send)
        if path not in (COMPLETIONS, CHAT):
            return await self.app(scope, receive, send)
        state = _state(scope["app"])
        body = await _read_body(receive, scope, MAX_BODY_BYTES)
        if body is None:
            return await _too_large(send)
        try:
            req = json.loads(body)
        except ValueError:
            req = None
        xargs = req.get("vllm_xargs") if isinstance(req, dict) else None
        ours = isinstance(xargs, dict) and has_lens_keys(xargs)
        if not ours and not state.persistent_hooks:
            return await self.app(scope, _replay(body, receive), send)
        if ours and HOOK_KEY in xargs and not remote_hooks_allowed():
            return await _send_json(send, 403, error_body(
                403, "hooks execute arbitrary code on the server and are disabled; the operator must start "
                     "the server with --allow-remote-hooks", f"vllm_xargs.{HOOK_KEY}", "Forbidden"))
        dialect = ours and original_dialect(xargs)  # before _precheck rewrites raw `true`
        if ours:
            try:
                _precheck(req, xargs, _shape(state))
            except _BadRequest as e:
                return await _send_json(send, e.status, error_body(e.status, e.message, e.param, "BadRequestError"))
        req["return_token_ids"] = True  # positions of activations align with these tokens
        body = json.dumps(req).encode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        scope = dict(scope, headers=headers + [(b"content-length", str(len(body)).encode())])
        kind = "chat" if path == CHAT else "cmpl"
        n = int(req.get("n") or 1)
        # requests that asked for results must get them (steering-only ones have nothing to fetch)
        expect = ours and any(k in xargs for k in (CAPTURE_KEY, HOOK_KEY))
        if req.get("stream"):
            return await self.app(scope, _replay(body, receive), _StreamInjector(send, state, kind, n, expect).send)
        await self._buffered(scope, _replay(body, receive), send, state, kind, n, expect, dialect)

    async def _buffered(self, scope: dict, receive: Any, send: Any, state: LensState, kind: str, n: int,
                        expect: bool, dialect: bool = False) -> None:
        start: dict | None = None
        chunks: list[bytes] = []

        async def capture(msg: dict) -> None:
            nonlocal start
            if msg["type"] == "http.response.start":
                start = msg
            elif msg["type"] == "http.response.body":
                chunks.append(msg.get("body", b""))

        await self.app(scope, receive, capture)
        raw = b"".join(chunks)
        assert start is not None
        if start["status"] != 200:
            await send(start)
            return await send({"type": "http.response.body", "body": raw})
        resp = json.loads(raw)
        choices = [_Choice(c["index"], c.get("prompt_token_ids") or resp.get("prompt_token_ids") or [],
                           c.get("token_ids") or []) for c in resp.get("choices", [])]
        try:
            extra, errors = await _results(state, kind, resp["id"], n, choices, expect, dialect)
        except _Unmatched as e:
            return await _send_json(send, 500, error_body(500, str(e), None, "InternalServerError"))
        if errors:
            return await _send_json(send, 500 if _internal(errors) else 400, _hook_failure(errors),
                                    start.get("headers"))
        if dialect and resp["choices"]:  # the original's client reads the first choice's results up here
            resp.update(extra.pop(resp["choices"][0]["index"], {}))
        for c in resp["choices"]:
            c.update(extra.get(c["index"], {}))
        await _send_json(send, 200, resp, start.get("headers"))
        await _release(resp, extra)


class _StreamInjector:
    """Passes SSE events through, remembers token ids per choice, and adds one chunk with the
    activations and hook results of every choice just before `data: [DONE]`."""

    def __init__(self, send: Any, state: LensState, kind: str, n: int, expect: bool) -> None:
        self._send, self.state, self.kind, self.n, self.expect = send, state, kind, n, expect
        self.buf = b""
        self.response_id: str | None = None
        self.obj: str | None = None
        self.choices: dict[int, _Choice] = {}

    def _observe(self, event: bytes) -> None:
        if not event.startswith(b"data: ") or event.startswith(b"data: [DONE]"):
            return
        try:
            chunk = json.loads(event[6:])
        except ValueError:
            return
        self.response_id = self.response_id or chunk.get("id")
        self.obj = self.obj or chunk.get("object")
        top_prompt = chunk.get("prompt_token_ids")
        for c in chunk.get("choices") or []:
            st = self.choices.setdefault(c["index"], _Choice(c["index"]))
            st.prompt_ids = st.prompt_ids or c.get("prompt_token_ids") or top_prompt or []
            st.token_ids.extend(c.get("token_ids") or [])

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
                self._observe(event)
            out += event + b"\n\n"
        if out or not msg.get("more_body", False):
            await self._send({"type": "http.response.body", "body": out + (b"" if msg.get("more_body") else self.buf),
                              "more_body": msg.get("more_body", False)})

    async def _final_event(self) -> bytes:
        if self.response_id is None:
            return b""
        try:
            extra, errors = await _results(self.state, self.kind, self.response_id, self.n,
                                           [self.choices[i] for i in sorted(self.choices)], self.expect)
        except _Unmatched as e:
            return b"data: " + json.dumps(error_body(500, str(e), None, "InternalServerError")).encode() + b"\n\n"
        if errors:
            return b"data: " + json.dumps(_hook_failure(errors)).encode() + b"\n\n"
        extra = {i: e for i, e in extra.items() if e}  # steering-only choices have nothing to add
        if not extra:
            return b""
        chunk = {"id": self.response_id, "object": self.obj,
                 "choices": [dict(index=i, **extra[i]) for i in sorted(extra)]}
        return b"data: " + b"".join(await _dumps(chunk)) + b"\n\n"


# ---------------------------------------------------------------- /v1/hooks/*

HOOKS_PREFIX = "/v1/hooks"
router = APIRouter(prefix=HOOKS_PREFIX)


async def _json(request: Request) -> dict:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise _BadRequest(413, f"request body exceeds the limit of {MAX_BODY_BYTES} bytes (VLLM_LENS_MAX_PAYLOAD_MB)",
                          "body")
    if not raw:
        return {}
    try:
        obj = json.loads(raw)
    except ValueError:
        raise _BadRequest(400, "request body is not valid JSON", "body") from None
    if not isinstance(obj, dict):
        raise _BadRequest(400, "request body must be a JSON object", "body")
    return obj


class _BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None) -> None:
        self.status, self.message, self.param = status, message, param


def _guard(fn):
    import functools

    @functools.wraps(fn)
    async def wrapper(request: Request):
        try:
            return await fn(request)
        except _BadRequest as e:
            return _error(e.status, e.message, e.param)
        except PermissionError as e:
            return _error(403, str(e), "hooks", "Forbidden")
        except (ValueError, KeyError) as e:
            msg = str(e).strip("'\"")
            return _error(400, msg, msg.split(":", 1)[0] if ":" in msg else None)

    return wrapper


def _shape(state: LensState) -> ModelShape:
    if state.shape is None:
        state.shape = ModelShape(*adapter.model_shape(adapter.processor_of_engine_client(state.engine)))
    return state.shape


def _names(obj: dict, key: str) -> list[str]:
    names = obj.get(key) or []
    if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
        raise _BadRequest(400, f"{key}: expected a list of parameter names", key)
    return names


@router.post("/register")
@_guard
async def register(request: Request):
    state = _state(request.app)
    if not remote_hooks_allowed():
        raise PermissionError("hooks execute arbitrary code on the server and are disabled; the operator must "
                              "start the server with --allow-remote-hooks")
    body = await _json(request)
    unknown = set(body) - {"hooks", "prefetch_params"}
    if unknown:
        raise _BadRequest(400, f"unknown fields {sorted(unknown)}", sorted(unknown)[0])
    hooks = body.get("hooks")
    if not isinstance(hooks, list) or not hooks:
        raise _BadRequest(400, "hooks: expected a non-empty list", "hooks")
    try:
        specs = parse_hooks(hooks, _shape(state))
    except ValueError as e:  # name the field of this body (`hooks[0].fn`), not the generation key's
        msg = str(e)
        msg = "hooks" + msg[len(HOOK_KEY):] if msg.startswith(HOOK_KEY) else msg
        raise _BadRequest(400, msg, msg.split(":", 1)[0]) from None
    names = _names(body, "prefetch_params")
    if names:
        await _prefetch(state, names, "prefetch_params")
    counts = await adapter.rpc_async(state.engine, "lens_register_hooks", [(h.fn, h.layers, h.pre) for h in specs])
    state.persistent_hooks = True
    state.original_collect = _mentions(hooks, '"cloudpickle"')
    return {"status": "ok", "registered": counts[0], "count": counts[0]}


@router.post("/collect")
@_guard
async def collect(request: Request):
    state = _state(request.app)
    results = merge_collected(await adapter.rpc_async(state.engine, "lens_collect_hook_results"))
    encode = to_original_jsonable if state.original_collect else to_jsonable
    return {"status": "ok", "results": await asyncio.to_thread(encode, results), "count": len(results)}


@router.post("/clear")
@_guard
async def clear(request: Request):
    state = _state(request.app)
    await adapter.rpc_async(state.engine, "lens_clear_hooks")
    state.persistent_hooks = state.original_collect = False
    return {"status": "ok", "cleared": True}


@router.post("/clear_results")
@_guard
async def clear_results(request: Request):
    await adapter.rpc_async(_state(request.app).engine, "lens_clear_hook_results")
    return {"status": "ok", "cleared": True}


@router.post("/prefetch")
@_guard
async def prefetch(request: Request):
    names = _names(await _json(request), "names")
    done = await _prefetch(_state(request.app), names, "names")
    return {"status": "ok", "prefetched": done, "count": len(done)}


async def _prefetch(state: LensState, names: list[str], param: str) -> list[str]:
    """Worker-side KeyError for an unknown parameter (it travels back as an RPC failure) -> 400."""
    try:
        return (await adapter.rpc_async(state.engine, "lens_prefetch", names))[0]
    except Exception as e:
        if "no pipeline stage has a parameter" in str(e):
            msg = str(e)[str(e).index("no pipeline stage"):].split("\n")[0].strip("'\"")
            raise _BadRequest(400, f"{param}: {msg}", param) from None
        raise


@router.post("/clear_prefetched")
@_guard
async def clear_prefetched(request: Request):
    await adapter.rpc_async(_state(request.app).engine, "lens_clear_prefetched")
    return {"status": "ok", "cleared": True}


info_router = APIRouter(prefix="/v1/lens")


@info_router.get("/info")
@_guard
async def info(request: Request):
    import vllm

    state = _state(request.app)
    shape = _shape(state)
    await release_results_async(state.engine)  # what responses already sent no longer hold
    status = await adapter.rpc_async(state.engine, "lens_status")
    return {"n_layers": shape.n_layers, "d_model": shape.d_model, "vllm_version": vllm.__version__,
            "remote_hooks": remote_hooks_allowed(),
            # results waiting for a consumer: both return to 0 once requests finish or are aborted
            "pending_results": pending_count(adapter.processor_of_engine_client(state.engine)),
            "stored_requests": sum(st["stored_requests"] for st in status),
            # shared-memory result regions handed out and not yet given back (0 once responses are sent)
            "result_regions": sum(st.get("result_regions", 0) for st in status),
            # captures admitted and not yet returned, at their largest (counted against VLLM_LENS_MAX_STORED_GB)
            "capture_bytes_in_flight": in_flight_bytes(adapter.processor_of_engine_client(state.engine)),
            "limits": {lim.env: limit(lim.env) for lim in LIMITS.values()}}


class LensEndpoints:
    """The `vllm.endpoint_plugins` entry (`inspect_lens_http`); `vllm-lens serve` allow-lists it."""

    name = "inspect_lens_http"
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        app.include_router(router)
        app.include_router(info_router)
        app.add_middleware(LensMiddleware)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        state.lens = LensState(engine_client)
        if engine_client is not None:
            mark_consumer(adapter.processor_of_engine_client(engine_client), "http")
