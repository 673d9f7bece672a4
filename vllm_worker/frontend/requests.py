"""Each new request in the frontend: its inspect-lens keys validated and encoded for the workers (a bad
field is a `ValueError` / HTTP 400 naming it), its capture admitted against the limits before any compute,
and an entry in the pending map until its results are fetched (`fetch`)."""

from __future__ import annotations

from typing import Any

from vllm_worker import compat
from vllm_worker.envs import limit
from vllm_worker.frontend import vector_refs
from vllm_worker.frontend.spec_memo import remembered_spec
from vllm_worker.frontend.state import FrontendState, Pending, engine_shape, engine_state, pending_of
from vllm_worker.frontend.validation import parse_request
from vllm_worker.frontend.vectors import resolve as resolve_vectors
from vllm_worker.protocol.host_threads import one_thread
from vllm_worker.protocol.spec import (
    CAPTURE_KEY,
    NAMESPACE_PREFIXES,
    PAYLOAD_KEY,
    VECTOR_DROPS_KEY,
    cache_salt,
    encode,
    has_lens_keys,
)
from vllm_worker.transport import result_views, shm


def on_new_request(processor: Any, request_id: str, req: Any) -> Any:
    """Called with vLLM's private `EngineCoreRequest` (its SamplingParams are already a clone). Its vectors'
    copies, checks and encoding run in one thread: cheaper than waking torch's pool (host_threads)."""
    with one_thread():
        return _on_new_request(processor, request_id, req)


def _on_new_request(processor: Any, request_id: str, req: Any) -> Any:
    sp = getattr(req, "sampling_params", None)
    if sp is None or not has_lens_keys(sp.extra_args):
        return req
    state = engine_state(processor)
    shape = engine_shape(processor)
    d_model = shape.d_model
    prompt_len = compat.request_prompt_len(req)
    named: list = []  # the registrations `apply_steering_vectors` names (which may go by reference)
    try:
        spec = remembered_spec(state, sp.extra_args, shape)
        if spec is None:
            spec = parse_request(
                resolve_vectors(sp.extra_args, state.vectors, named), shape, prompt_len, state.saes, state.probes
            )
    except PermissionError as e:
        raise compat.forbidden_error_cls()(str(e)) from None
    except ValueError as e:
        field = str(e).split(":", 1)[0]
        raise compat.validation_error_cls()(str(e), parameter=f"vllm_xargs.{field}") from None
    if spec is None:
        return req
    engines = state.engines_fed
    if engines is None:
        engines = state.engines_fed = compat.engines_fed(processor)
    why = compat.routing_unavailable() if spec.wants_results and engines > 1 else None
    if why is not None:
        raise compat.validation_error_cls()(
            f"results from a data-parallel server are not supported on this vLLM ({why}); serve with "
            "--data-parallel-size 1 or a vLLM inspect-lens supports for data parallelism",
            parameter="vllm_xargs",
        )
    payload = encode(spec)
    payload["n"] = int(sp.n)
    if spec.capture:  # a worker on this machine may prepare the result's shared memory while it runs
        payload["shm"] = shm.host_id()
        # result memory the caller has let go of rides along: the worker reuses it for this request
        # instead of growing its pool (otherwise it goes back only with the next fetch)
        # (under data parallelism the engine is not chosen yet: each engine's regions go back with its fetches)
        released = result_views.take_released(state.pools, unmap=False) if engines == 1 else None
        if released:
            payload["release"] = released
    args = {k: v for k, v in sp.extra_args.items() if not (isinstance(k, str) and k.startswith(NAMESPACE_PREFIXES))}
    args[PAYLOAD_KEY] = payload
    sp.extra_args = args
    if spec.wants_results:
        # Every captured / hooked / SAE-read position must run a forward pass: don't read cached KV.
        sp.skip_reading_prefix_cache = True
    consumer = state.consumer
    if spec.wants_results or consumer is not None:
        # with a consumer every request is fetched at the end, steering-only ones too: a failure of our
        # own code is then reported to the request it hit instead of passing unnoticed
        payload["fetch"] = True
        if consumer is None:
            # Nobody would ever fetch the results: refuse instead of silently returning nothing.
            raise compat.validation_error_cls()(
                "output_residual_stream/apply_hooks: this engine has no inspect-lens consumer for results; "
                "use vllm.LLM, LLMEngine.add_request/step or AsyncLLM(Engine).generate, or serve with "
                "`vllm-lens serve` (or set VLLM_PLUGINS=inspect_lens_worker,inspect_lens_http for `vllm serve`)",
                parameter="vllm_xargs",
            )
        if request_id in state.pending:  # its results, and its pins, would go to the one in flight
            raise compat.validation_error_cls()(
                f"request_id: {request_id!r} is already in flight with inspect-lens results to fetch; give each "
                "request its own id",
                parameter="request_id",
            )
        reserved = _admit_capture(processor, state, spec.capture, prompt_len, sp, d_model, engines)
        # (by reference only where this pending entry unpins them: it goes when the request is fetched or aborted)
        refs = vector_refs.by_reference(processor, spec, payload, named) if named and engines == 1 else ()
        if refs:
            state.pending.unpin = state.vectors.unpin
        state.pending[request_id] = Pending(
            spec.key, int(sp.n), spec.capture, d_model, reserved, spec.points, shape, spec.probe_outputs, prompt_len,
            vector_refs=refs,
        )  # fmt: skip
    salt = cache_salt(spec)
    if salt is not None:
        # Steered / hooked KV is stored under its own hash: no other request can ever read it.
        compat.set_request_cache_salt(req, salt)
    if engines == 1 and state.vectors is not None:
        gone = vector_refs.drops(processor)  # (last: a request refused above would lose them)
        if gone:
            payload[VECTOR_DROPS_KEY] = gone
    if payload.get("steer") and _rows_by_view(processor, state):
        payload["steer"] = [_viewed(s) for s in payload["steer"]]
    return req


def _rows_by_view(processor: Any, state: Any) -> bool:
    if state.rows_by_view is None:
        state.rows_by_view = compat.rows_by_view(processor)
    return state.rows_by_view


def _viewed(steer: dict[str, Any]) -> dict[str, Any]:
    """The steer with its rows' bytes as `compat.raw_view`: the engine core decodes them as a view of the
    message it received instead of copying them into new memory (a new dict: `encode`'s may be memoised)."""
    vec = steer.get("vec")
    if not isinstance(vec, dict) or not isinstance(vec.get("data"), bytes):
        return steer  # (by reference: no bytes)
    return {**steer, "vec": {**vec, "data": compat.raw_view(vec["data"])}}


def _admit_capture(
    processor: Any, state: FrontendState, layers: list[int], prompt_len: int, sp: Any, d_model: int, engines: int
) -> int:
    """Refuse a capture up front, before any compute, when at its largest it would pass the per-request
    limit or the in-flight total (instead of being dropped half-way by the workers' store cap)."""
    if not layers:
        return 0
    if state.capture_limits is None:
        state.capture_limits = compat.model_capture_limits(processor)
    max_len, itemsize = state.capture_limits
    positions = prompt_len + (sp.max_tokens if sp.max_tokens is not None else max_len - prompt_len) - 1
    need = len(layers) * max(positions, 1) * d_model * itemsize * int(sp.n)
    per_request = limit("VLLM_LENS_MAX_CAPTURE_GB")
    if need > per_request:
        raise compat.validation_error_cls()(
            f"{CAPTURE_KEY}: this capture needs up to {need / 2**30:.2f} GiB ({len(layers)} layers x {positions} "
            f"positions x d_model {d_model} x n {sp.n}), above the server's per-request limit of "
            f"{per_request / 2**30:.2f} GiB (VLLM_LENS_MAX_CAPTURE_GB); capture fewer layers, lower max_tokens "
            "or split the request",
            parameter=f"vllm_xargs.{CAPTURE_KEY}",
        )
    # the limit is per engine (each data-parallel engine's workers store their own requests' captures)
    total = limit("VLLM_LENS_MAX_STORED_GB") * engines
    in_flight = state.pending.reserved
    if in_flight + need > total:
        per = f" ({engines} data-parallel engines x {total / engines / 2**30:.2f} GiB)" if engines > 1 else ""
        raise compat.capacity_error_cls()(
            f"{CAPTURE_KEY}: captures in flight would reach {(in_flight + need) / 2**30:.2f} GiB, above the "
            f"server's limit of {total / 2**30:.2f} GiB{per} (VLLM_LENS_MAX_STORED_GB); retry when earlier "
            "requests have returned"
        )
    return need


def fetch_key(req: Any) -> str | None:
    """Our key of an `EngineCoreRequest` whose results will be fetched (None for any other request)."""
    sp = getattr(req, "sampling_params", None)
    payload = (getattr(sp, "extra_args", None) or {}).get(PAYLOAD_KEY)
    return str(payload["key"]) if isinstance(payload, dict) and payload.get("fetch") else None


def in_flight_bytes(processor: Any) -> int:
    return pending_of(processor).reserved


def forget(processor: Any, request_ids: list[str]) -> list[str]:
    """Aborted requests: drop their pending entries; returns the keys whose worker stores to drop."""
    pending = pending_of(processor)
    keys = []
    for rid in request_ids:
        p = pending.pop(rid, None)
        if p is None:  # an internal id: `<external id>-<8 hex>`
            p = pending.pop(compat.external_request_id(rid, 1), None)
        if p is not None:
            keys.append(p.key)
    return keys


def pending_count(processor: Any) -> int:
    return len(pending_of(processor))
