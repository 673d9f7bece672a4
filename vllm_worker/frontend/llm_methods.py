"""Persistent (Garçon-style) hooks on an offline `vllm.LLM`: registered once, fired on every request.

llm.register_hooks([Hook(fn, [3])])           # appends
llm.generate(...)                              # every request runs them
llm.collect_hook_results()                     # {request_id: {"0": saved, ...}}, non-destructive
llm.clear_hook_results()                       # keeps the hooks
llm.clear_hooks()                              # removes hooks and results
llm.prefetch_params(["lm_head.weight"]) / llm.clear_prefetched()

Named vectors (`frontend.vectors`): llm.register_vector(name, tensor) / llm.list_vectors() /
llm.delete_vector(name); then SteeringVector(name=name, layer_indices=[...], scale=...).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from vllm_worker import compat
from vllm_worker.api.hooks import Hook
from vllm_worker.frontend import probes, saes, vector_refs
from vllm_worker.frontend.fetch import merge_collected
from vllm_worker.frontend.state import engine_shape, engine_state
from vllm_worker.frontend.validation import parse_hooks
from vllm_worker.frontend.vectors import check_name, check_vector, registry_of
from vllm_worker.protocol import rpc


def register_hooks(self: Any, hooks: Sequence[Hook], prefetch_params: Sequence[str] | None = None) -> int:
    """Append persistent hooks; returns how many are registered now."""
    specs = parse_hooks(list(hooks), engine_shape(compat.processor_of_llm(self)))
    if prefetch_params:
        self.prefetch_params(prefetch_params)
    counts = compat.rpc(self, rpc.REGISTER_HOOKS, [h.rpc() for h in specs])
    engine_state(self).persistent_hooks = True
    return counts[0]


def collect_hook_results(self: Any) -> dict[str, dict[str, Any]]:
    return merge_collected(compat.rpc(self, rpc.COLLECT_HOOK_RESULTS))


def clear_hook_results(self: Any) -> None:
    compat.rpc(self, rpc.CLEAR_HOOK_RESULTS)


def clear_hooks(self: Any) -> None:
    compat.rpc(self, rpc.CLEAR_HOOKS)
    engine_state(self).persistent_hooks = False


def prefetch_params(self: Any, names: Sequence[str]) -> list[str]:
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError("prefetch_params: expected a list of parameter names")
    return compat.rpc(self, rpc.PREFETCH, list(names))[0]


def clear_prefetched(self: Any) -> None:
    compat.rpc(self, rpc.CLEAR_PREFETCHED)


def register_vector(self: Any, name: str, tensor: Any) -> dict[str, Any]:
    """Register (or replace) `tensor` as `name` for steering entries to name; returns its description
    (name, shape, dtype, bytes). The tensor is copied: later edits of the caller's do not reach it."""
    proc = compat.processor_of_llm(self)
    vec = check_vector(tensor, engine_shape(proc), "register_vector.tensor")
    registry = registry_of(proc)
    info = registry.register("", check_name(name, "register_vector.name"), vec)
    vector_refs.push(self, proc, registry, registry.entry("", info["name"], "register_vector.name"))
    return info


def list_vectors(self: Any) -> list[dict[str, Any]]:
    return registry_of(compat.processor_of_llm(self)).list("")


def delete_vector(self: Any, name: str) -> bool:
    """True when `name` was registered (and is now gone)."""
    return registry_of(compat.processor_of_llm(self)).delete("", name)


METHODS: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (
        register_hooks,
        collect_hook_results,
        clear_hook_results,
        clear_hooks,
        prefetch_params,
        clear_prefetched,
        register_vector,
        list_vectors,
        delete_vector,
    )
}
METHODS.update(saes.METHODS)
METHODS.update(probes.METHODS)
