"""`POST /v1/lens/saes {"name", "path"}` (load an SAE in every worker; only from the folder the operator
named with `--lens-sae-dir`, 403 otherwise) and `GET /v1/lens/saes` (what is loaded)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from vllm_worker import compat
from vllm_worker.frontend import saes
from vllm_worker.frontend.state import engine_state
from vllm_worker.protocol import rpc
from vllm_worker.server import operator_dirs
from vllm_worker.server.routes import caller_input, guard, json_body
from vllm_worker.server.state import shape_of, state_of

SAE_DIR_ENV = "VLLM_LENS_SAE_DIR"

router = APIRouter(prefix="/v1/lens")


def allowed_path(path: object) -> str:
    """The SAE folder, resolved, when it lies inside the operator's `--lens-sae-dir`."""
    return operator_dirs.allowed_path(path, SAE_DIR_ENV, "SAE", "--lens-sae-dir")


@router.post("/saes")
@guard
async def load(request: Request):
    state = state_of(request.app)
    body = await json_body(request, frozenset({"name", "path"}))
    path = allowed_path(body.get("path"))
    with caller_input():
        loaded = saes.prepare(body.get("name"), path, shape_of(state))
    await compat.rpc_async(state.engine, rpc.LOAD_SAE, loaded.name, loaded.path, loaded.uid)
    engine_state(compat.processor_of_engine_client(state.engine)).saes[loaded.name] = loaded
    return {"status": "ok", "sae": loaded.describe()}


@router.get("/saes")
@guard
async def listing(request: Request):
    got = engine_state(compat.processor_of_engine_client(state_of(request.app).engine)).saes
    return {"saes": [s.describe() for s in got.values()]}
