"""ASGI middleware on `/v1/completions` and `/v1/chat/completions`: checks our `vllm_xargs` keys on the
raw JSON (vLLM would turn `true` into layer 1), asks vLLM for token ids, and adds `activations` /
`hook_results` to every choice of the response (streaming: `streaming`)."""

from __future__ import annotations

import json
from typing import Any

from vllm_worker.protocol.spec import (
    ACTIVATIONS_KEY,
    ALL_LAYERS,
    CAPTURE_KEY,
    HOOK_KEY,
    PROBE_KEYS,
    PROBE_SCORES_KEY,
    SAE_FEATURES_KEY,
    SAE_KEYS,
    ModelShape,
    capture_layers,
    has_lens_keys,
    require_remote_hooks,
)
from vllm_worker.server.choices import Choice, Unmatched, fetch_results, hook_failure, internal_only, original_dialect
from vllm_worker.server.responses import (
    BadRequest,
    error_body,
    max_body_bytes,
    read_body,
    release,
    replay,
    send_json,
    too_large,
)
from vllm_worker.server.routes import HOOKS_PREFIX
from vllm_worker.server.state import LensState, shape_of, state_of
from vllm_worker.server.streaming import StreamInjector
from vllm_worker.server.vectors import VECTORS_PATH, stamp_scope

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def _precheck(req: dict, xargs: dict, shape: ModelShape) -> None:
    """Checks that must see the raw JSON: vLLM turns JSON booleans in `vllm_xargs` into ints (`true` would
    become layer 1) and some malformed fields would otherwise surface as empty 500s."""
    n = req.get("n", 1)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise BadRequest(400, f"n: expected a positive integer, got {str(n)[:40]!r}", "n")
    if req.get("use_beam_search"):
        raise BadRequest(
            400, "use_beam_search: capture, steering and hooks are not supported with beam search", "use_beam_search"
        )
    if isinstance(xargs.get(ACTIVATIONS_KEY), dict):  # raw JSON: vLLM takes only flat values, so a string
        xargs[ACTIVATIONS_KEY] = json.dumps(xargs[ACTIVATIONS_KEY])
    for key in (*SAE_KEYS, *PROBE_KEYS):  # objects / lists of objects: strings as well
        if key in xargs and not isinstance(xargs[key], str):
            xargs[key] = json.dumps(xargs[key])
    if CAPTURE_KEY in xargs:
        value = xargs[CAPTURE_KEY]
        if value is True:
            xargs[CAPTURE_KEY] = ALL_LAYERS  # the original tool's "every layer", kept a string for vLLM
            return
        try:
            capture_layers(value, shape.n_layers)
        except ValueError as e:
            raise BadRequest(400, str(e), f"vllm_xargs.{CAPTURE_KEY}") from None


def _n_of(req: dict) -> int:
    """Choices per prompt; a value vLLM will refuse (its 400 is forwarded as it is) counts as 1."""
    try:
        return max(1, int(req.get("n") or 1))
    except (TypeError, ValueError):
        return 1


class LensMiddleware:
    """Pure ASGI (streaming-safe) middleware on the two generation routes."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        if path.startswith(HOOKS_PREFIX + "/") or path == VECTORS_PATH:  # ours: bounded while reading
            body = await read_body(receive, scope, max_body_bytes())
            if body is None:
                return await too_large(send)
            return await self.app(scope, replay(body, receive), send)
        if path not in (COMPLETIONS, CHAT):
            return await self.app(scope, receive, send)
        state = state_of(scope["app"])
        body = await read_body(receive, scope, max_body_bytes())
        if body is None:
            return await too_large(send)
        try:
            req = json.loads(body)
        except ValueError:
            req = None
        raw_xargs = req.get("vllm_xargs") if isinstance(req, dict) else None
        xargs: dict = raw_xargs if isinstance(raw_xargs, dict) else {}
        ours = has_lens_keys(xargs)
        # not a JSON object: vLLM's own 400 (with persistent hooks on, it reached the code below: a 500)
        if not isinstance(req, dict) or (not ours and not state.persistent_hooks):
            return await self.app(scope, replay(body, receive), send)
        if ours and HOOK_KEY in xargs:
            try:
                require_remote_hooks(f"vllm_xargs.{HOOK_KEY}")
            except PermissionError as e:
                return await send_json(send, 403, error_body(403, str(e), f"vllm_xargs.{HOOK_KEY}", "Forbidden"))
        dialect = ours and original_dialect(xargs)  # before _precheck rewrites raw `true`
        if ours:
            stamp_scope(state, xargs, scope["headers"])  # named vectors: this caller's (frontend.vectors)
            try:
                _precheck(req, xargs, shape_of(state))
            except BadRequest as e:
                return await send_json(send, e.status, error_body(e.status, e.message, e.param, "BadRequestError"))
        req["return_token_ids"] = True  # positions of activations align with these tokens
        body = json.dumps(req).encode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        scope = dict(scope, headers=headers + [(b"content-length", str(len(body)).encode())])
        kind = "chat" if path == CHAT else "cmpl"
        n = _n_of(req)
        # requests that asked for results must get them (steering-only ones have nothing to fetch)
        expect = ours and any(
            k in xargs for k in (CAPTURE_KEY, ACTIVATIONS_KEY, HOOK_KEY, SAE_FEATURES_KEY, PROBE_SCORES_KEY)
        )
        if req.get("stream"):
            return await self.app(scope, replay(body, receive), StreamInjector(send, state, kind, n, expect).send)
        await self._buffered(scope, replay(body, receive), send, state, kind, n, expect, dialect)

    async def _buffered(
        self,
        scope: dict,
        receive: Any,
        send: Any,
        state: LensState,
        kind: str,
        n: int,
        expect: bool,
        dialect: bool = False,
    ) -> None:
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
        choices = [
            Choice(
                c["index"], c.get("prompt_token_ids") or resp.get("prompt_token_ids") or [], c.get("token_ids") or []
            )
            for c in resp.get("choices", [])
        ]
        try:
            extra, errors = await fetch_results(state, kind, resp["id"], n, choices, expect, dialect)
        except Unmatched as e:
            return await send_json(send, 500, error_body(500, str(e), None, "InternalServerError"))
        if errors:
            return await send_json(
                send, 500 if internal_only(errors) else 400, hook_failure(errors), start.get("headers")
            )
        if dialect and resp["choices"]:  # the original's client reads the first choice's results up here
            resp.update(extra.pop(resp["choices"][0]["index"], {}))
        for c in resp["choices"]:
            c.update(extra.get(c["index"], {}))
        await send_json(send, 200, resp, start.get("headers"))
        await release(resp, extra)
