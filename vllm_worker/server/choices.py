"""One response's results: its choices matched to our pending requests, fetched from the workers and
encoded as JSON (in our form or, for requests written for the original vllm-lens, in its form)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from vllm_worker import compat
from vllm_worker.frontend.fetch import decode_sample, fetch_batched
from vllm_worker.frontend.state import Pending, pending_of
from vllm_worker.protocol import rpc
from vllm_worker.protocol.errors import Failure, all_internal, messages
from vllm_worker.protocol.points import RESID_POST
from vllm_worker.protocol.spec import (
    ACTIVATIONS_KEY,
    CAPTURE_KEY,
    HOOK_KEY,
    PROBE_SCORES_KEY,
    SAE_FEATURES_KEY,
    STEER_KEY,
)
from vllm_worker.protocol.wire import tensor_to_original_json, to_jsonable, to_original_jsonable
from vllm_worker.server.responses import error_body
from vllm_worker.server.state import LensState


def mentions(value: Any, marker: str) -> bool:
    return marker in (value if isinstance(value, str) else json.dumps(value, default=str))


# results the original form has no place for: such a request is refused (400 naming the key), never
# answered without them
ORIGINAL_FORM_LACKS = (ACTIVATIONS_KEY, SAE_FEATURES_KEY, PROBE_SCORES_KEY)


def original_form_lacks(xargs: dict) -> str | None:
    """The first key of a request in the original's form whose results that form cannot carry."""
    return next((k for k in ORIGINAL_FORM_LACKS if k in xargs), None)


def original_dialect(xargs: dict) -> bool:
    """The request was written for the original vllm-lens: its client sends the layer list as a JSON
    string and its own tensor objects (`original_dtype`) and hook objects (`{"fn": {"cloudpickle": ...}}`).
    Our client and docs send a list, `b64` tensor objects and `{"fn": base64}` hooks."""
    if isinstance(xargs.get(CAPTURE_KEY), str):
        return True
    return (STEER_KEY in xargs and mentions(xargs[STEER_KEY], '"original_dtype"')) or (
        HOOK_KEY in xargs and mentions(xargs[HOOK_KEY], '"cloudpickle"')
    )


@dataclass
class Choice:
    index: int
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


class Unmatched(RuntimeError):
    """The response's ids do not lead to our pending requests: fail loudly, never drop results."""


async def fetch_results(
    state: LensState, kind: str, response_id: str, n: int, choices: list[Choice], expect: bool, dialect: bool = False
) -> tuple[dict[int, dict], dict[str, Failure]]:
    """({choice index: {"activations": ..., "hook_results": ...}}, {request id: error})."""
    pending = pending_of(compat.processor_of_engine_client(state.engine))
    by_request: dict[str, list[tuple[Choice, int]]] = {}
    for c in choices:
        rid = compat.server_request_id(response_id, kind, c.index // n if kind == "cmpl" else 0)
        child = c.index % n if kind == "cmpl" else c.index
        by_request.setdefault(rid, []).append((c, child))
    todo = []
    for rid, items in by_request.items():
        p: Pending | None = pending.pop(rid, None)
        if p is not None:
            todo.append((rid, p, {(ch if p.n > 1 else 0): len(c.prompt_ids) + len(c.token_ids) - 1 for c, ch in items}))
        elif expect:
            raise Unmatched(
                f"inspect-lens: no pending results for engine request {rid!r} of response "
                f"{response_id!r} (did vLLM change its request-id format?)"
            )
    merged = await fetch_batched(state.engine, [(p, ch) for _, p, ch in todo])
    # decoding and JSON conversion of large captures run in a worker thread: the event loop (health
    # checks, other requests' streams) keeps answering meanwhile
    out, errors = await asyncio.to_thread(decode_results, todo, by_request, merged, dialect)
    if state.persistent_hooks:
        for rank_errors in await compat.rpc_async(state.engine, rpc.POP_PERSISTENT_ERRORS, list(by_request)):
            errors.update(rank_errors or {})
    return out, errors


def decode_results(
    todo: list, by_request: dict, merged: dict, dialect: bool = False
) -> tuple[dict[int, dict], dict[str, Failure]]:
    """`dialect`: the original vllm-lens's forms (see `original_dialect`)."""
    out: dict[int, dict] = {}
    errors: dict[str, Failure] = {}
    for rid, p, _ in todo:
        for c, child in by_request[rid]:
            acts, hooks, err = decode_sample(p, merged.get(p.key, {}), child if p.n > 1 else 0)
            if err is not None:
                errors[rid if p.n == 1 else f"{rid}#{child}"] = err
                continue
            entry: dict[str, Any] = {}
            if acts is not None:
                if dialect:  # its decode_activations passes {"__json__": ...} entries through
                    entry["activations"] = {
                        "residual_stream": tensor_to_original_json(acts["residual_stream"]),
                        "layers": {"__json__": acts["layers"]},
                    }
                else:
                    entry["activations"] = activations_json(acts)
            if hooks is not None:
                entry["hook_results"] = to_original_jsonable(hooks) if dialect else to_jsonable(hooks, lazy=True)
            out[c.index] = entry
    return out, errors


def activations_json(acts: dict[str, Any]) -> dict[str, Any]:
    """Each point's tensor once (`resid_post` travels as `residual_stream`, its original name)."""
    out: dict[str, Any] = {"points": acts.get("points", {})}
    if "sae_features" in acts:  # {SAE name: {"positions", "indices", "values"}}
        out["sae_features"] = to_jsonable(acts["sae_features"], lazy=True)
    for key in ("probe_scores", "probe_aggregates"):  # {probe: (n_pos, n_out)}, {probe: {aggregate: (n_out,)}}
        if key in acts:
            out[key] = to_jsonable(acts[key], lazy=True)
    for point in out["points"]:
        if point == RESID_POST:
            out["residual_stream"], out["layers"] = to_jsonable(acts[point], lazy=True), acts["layers"]
        else:
            out[point] = to_jsonable(acts[point], lazy=True)
    if "expert_ids" in acts:
        out["expert_ids"] = to_jsonable(acts["expert_ids"], lazy=True)
    if "probe_actions" in acts:  # plain JSON already: [{"action", "name", "fired", "position", ...}]
        out["probe_actions"] = acts["probe_actions"]
    return out


def internal_only(errors: dict[str, Failure]) -> bool:
    """Failures of our own code (not of the user's hook): a 500, not a 400."""
    return all_internal(errors)


def hook_failure(errors: dict[str, Failure]) -> dict:
    """The error answer for failed results. The field named is the one whose use failed: `apply_hooks` only
    when a caller's hook failed, the capture key when captures were dropped at a limit, `vllm_xargs`
    otherwise; our own failures name no field (500) unless the caller's are among them."""
    lines = "\n".join(f"request {r}: {m}" for r, m in messages(errors).items())
    if internal_only(errors):
        return error_body(500, "inspect-lens request failed\n" + lines, None, "InternalServerError")
    kinds = {f["kind"] for f in errors.values()} - {"internal"}
    if kinds == {"unsupported"}:
        return error_body(400, "inspect-lens request refused\n" + lines, "vllm_xargs", "BadRequestError")
    if kinds == {"hook"}:
        return error_body(400, "inspect-lens hook failed\n" + lines, f"vllm_xargs.{HOOK_KEY}", "HookError")
    field = f"vllm_xargs.{CAPTURE_KEY}" if kinds == {"limit"} else "vllm_xargs"
    return error_body(400, "inspect-lens request failed\n" + lines, field, "BadRequestError")
