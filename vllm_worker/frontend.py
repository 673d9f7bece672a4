"""Frontend side: validate and encode each new request's features, and attach captures to outputs.

Runs in the process that owns the `LLM` (or API server). Captures stay in the workers until the
request finishes; then they are fetched by RPC in groups small enough to stay far below vLLM's
engine-to-frontend message limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import adapter
from .hooks import HookError
from .spec import PAYLOAD_KEY, ModelShape, cache_salt, encode, has_lens_keys, parse_request
from .wire import tensor_from_bytes

FETCH_GROUP_BYTES = 512 << 20  # per RPC round trip


@dataclass
class Pending:
    key: str
    n: int
    layers: list[int]
    d_model: int


def _pending(processor: Any) -> dict[str, Pending]:
    p = getattr(processor, "_lens_pending", None)
    if p is None:
        p = processor._lens_pending = {}
    return p


def on_new_request(processor: Any, request_id: str, req: Any) -> Any:
    """Called with vLLM's private `EngineCoreRequest` (its SamplingParams are already a clone)."""
    sp = getattr(req, "sampling_params", None)
    if sp is None or not has_lens_keys(sp.extra_args):
        return req
    n_layers, d_model = adapter.model_shape(processor)
    spec = parse_request(sp.extra_args, ModelShape(n_layers, d_model), adapter.request_prompt_len(req))
    if spec is None:
        return req
    payload = encode(spec)
    payload["n"] = int(sp.n)
    args = {k: v for k, v in sp.extra_args.items() if not has_lens_keys({k: v})}
    args[PAYLOAD_KEY] = payload
    sp.extra_args = args
    if spec.capture or spec.hooks:
        # Every captured / hooked position must run a forward pass: don't read cached KV.
        sp.skip_reading_prefix_cache = True
    if spec.wants_results:
        _pending(processor)[request_id] = Pending(spec.key, int(sp.n), spec.capture, d_model)
    salt = cache_salt(spec)
    if salt is not None:
        # Steered KV is stored under its own hash: it can never be read by an unsteered request.
        adapter.set_request_cache_salt(req, salt)
    return req


def _fetch(engine: Any, todo: list[tuple[Pending, dict[int, int]]]) -> dict[str, dict]:
    """RPC in groups of bounded size; merges the layers each worker (PP stage) returns."""
    merged: dict[str, dict] = {}
    group: list = []
    size = 0

    def flush() -> None:
        nonlocal group, size
        if not group:
            return
        for rank_result in adapter.rpc(engine, "lens_fetch", [(p.key, ch) for p, ch in group]):
            for key, per_child in (rank_result or {}).items():
                dst = merged.setdefault(key, {})
                if "error" in per_child:
                    dst["error"] = per_child["error"]
                    continue
                for child, payload in per_child.items():
                    dst.setdefault(int(child), []).append(payload)
        group, size = [], 0

    for p, children in todo:
        est = sum(children.values()) * len(p.layers) * p.d_model * 4
        if group and size + est > FETCH_GROUP_BYTES:
            flush()
        group.append((p, children))
        size += est
    flush()
    return merged


def _assemble(p: Pending, parts: list[dict]) -> torch.Tensor:
    by_layer: dict[int, torch.Tensor] = {}
    for part in parts:
        if "error" in part:
            raise RuntimeError(f"inspect-lens capture failed: {part['error']}")
        t = tensor_from_bytes(part["tensor"], "residual_stream")
        for i, layer in enumerate(part["layers"]):
            by_layer.setdefault(layer, t[i])
    missing = [l for l in p.layers if l not in by_layer]
    if missing:
        raise RuntimeError(f"inspect-lens: no worker returned captures for layers {missing}")
    return torch.stack([by_layer[l] for l in p.layers])


def attach_outputs(llm: Any, outputs: list) -> list:
    """Set `.activations` on finished `RequestOutput`s (and each sample's `CompletionOutput`)."""
    pending = _pending(adapter.processor_of_llm(llm))
    if not pending:
        return outputs
    todo = []
    for out in outputs:
        p = pending.pop(getattr(out, "request_id", None), None)
        if p is None or not hasattr(out, "outputs"):
            continue
        n_prompt = len(out.prompt_token_ids or [])
        children = {c.index if p.n > 1 else 0: n_prompt + len(c.token_ids) - 1 for c in out.outputs}
        todo.append((out, p, children))
    if not todo:
        return outputs
    fetched = _fetch(llm, [(p, ch) for _, p, ch in todo])
    for out, p, children in todo:
        got = fetched.get(p.key, {})
        if "error" in got:
            raise RuntimeError(f"inspect-lens: request {out.request_id}: {got['error']}")
        for c in out.outputs:
            child = c.index if p.n > 1 else 0
            parts = got.get(child)
            if not parts:
                raise RuntimeError(f"inspect-lens: no captures came back for request {out.request_id}")
            c.activations = {"residual_stream": _assemble(p, parts), "layers": list(p.layers)}
        out.activations = out.outputs[0].activations
    return outputs
