"""`server.routes.guard`: only the caller's failures (told apart by class: `BadRequest`,
`protocol.errors.CallerError`, a refused opt-in) become 4xx; a KeyError / ValueError of our own code is a
500 with a JSON body, whatever its wording. (The routes themselves run against a real server in
tests/http; here a FastAPI app of our guard alone, nothing of vLLM.)"""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from vllm_worker.protocol import errors
from vllm_worker.server.responses import BadRequest
from vllm_worker.server.routes import guard


def _client(exc: BaseException) -> TestClient:
    app = FastAPI()

    @app.post("/x")
    @guard
    async def route(request: Request):
        raise exc

    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize(
    "exc",
    [
        KeyError("names: looks like a field"),
        ValueError("hooks: looks like the caller's"),
        RuntimeError("no pipeline stage has a parameter 'x'"),
    ],
)
def test_our_own_failures_are_500_with_a_json_body(exc):
    r = _client(exc).post("/x")
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == 500 and err["param"] is None and type(exc).__name__ in err["message"]


def test_caller_failures_are_4xx_naming_the_field():
    r = _client(BadRequest(413, "too big", "body")).post("/x")
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"
    r = _client(errors.CallerError(errors.failure("unsupported", "names: no such parameter"), "names")).post("/x")
    assert r.status_code == 400 and r.json()["error"]["param"] == "names"
    r = _client(errors.CallerError(errors.failure("limit", "over the limit"), "n")).post("/x")
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = _client(PermissionError("hooks: remote hooks are off")).post("/x")
    assert r.status_code == 403 and r.json()["error"]["param"] == "hooks"


def test_an_internal_failure_kind_is_never_a_4xx():
    with pytest.raises(ValueError, match="internal"):
        errors.CallerError(errors.failure("internal", "ours"), None)
