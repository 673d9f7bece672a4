"""`POST /v1/lens/probes {"name", "path", "replace"}` (load a probe in every worker; only from the folder the
operator named with `--lens-probe-dir`, 403 otherwise; `"replace": false`: a name already loaded with other
weights is a 409, so clients sharing a server never swap each other's probe), `GET /v1/lens/probes` (what is loaded) and
`DELETE /v1/lens/probes/{name}`."""

from __future__ import annotations

from fastapi import APIRouter, Request

from vllm_worker import compat
from vllm_worker.frontend import probes
from vllm_worker.frontend.state import engine_state
from vllm_worker.protocol import rpc
from vllm_worker.server import operator_dirs
from vllm_worker.server.responses import BadRequest
from vllm_worker.server.routes import caller_input, guard, json_body
from vllm_worker.server.state import shape_of, state_of

PROBE_DIR_ENV = "VLLM_LENS_PROBE_DIR"

router = APIRouter(prefix="/v1/lens")


def allowed_path(path: object) -> str:
    """The probe folder, resolved, when it lies inside the operator's `--lens-probe-dir`."""
    return operator_dirs.allowed_path(path, PROBE_DIR_ENV, "probe", "--lens-probe-dir")


@router.post("/probes")
@guard
async def load(request: Request):
    state = state_of(request.app)
    body = await json_body(request, frozenset({"name", "path", "replace"}))
    replace = body.get("replace", True)
    if not isinstance(replace, bool):
        raise BadRequest(400, f"replace: expected true or false, got {replace!r}"[:300], "replace")
    path = allowed_path(body.get("path"))
    with caller_input():
        loaded = probes.prepare(body.get("name"), path, shape_of(state))
    have = engine_state(compat.processor_of_engine_client(state.engine)).probes.get(loaded.name)
    if have is not None and not replace:
        if have.uid != loaded.uid:
            raise BadRequest(
                409,
                f"name: probe {loaded.name!r} is loaded with other weights (hash {have.uid}, from {have.path}); "
                f"this folder's hash is {loaded.uid}: load it under another name, or send replace: true",
                "name",
            )
        return {"status": "ok", "probe": have.describe()}  # the same probe: nothing to load
    answers = await compat.rpc_async(state.engine, rpc.LOAD_PROBE, loaded.name, loaded.uid, loaded.wire())
    try:
        with caller_input():
            probes.check_local(loaded, answers)
    except BadRequest:
        await compat.rpc_async(state.engine, rpc.DELETE_PROBE, loaded.name)
        raise
    engine_state(compat.processor_of_engine_client(state.engine)).probes[loaded.name] = loaded
    return {"status": "ok", "probe": loaded.describe()}


@router.get("/probes")
@guard
async def listing(request: Request):
    got = engine_state(compat.processor_of_engine_client(state_of(request.app).engine)).probes
    return {"probes": [p.describe() for p in got.values()]}


@router.delete("/probes/{name}")
@guard
async def delete(request: Request):
    state = state_of(request.app)
    name = request.path_params["name"]
    had = engine_state(compat.processor_of_engine_client(state.engine)).probes.pop(name, None) is not None
    await compat.rpc_async(state.engine, rpc.DELETE_PROBE, name)
    if not had:
        raise BadRequest(404, f"name: no probe {name[:128]!r} is loaded", "name")
    return {"status": "ok", "deleted": name}
