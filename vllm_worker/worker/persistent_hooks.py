"""Worker side of persistent hooks: registered once (`llm.register_hooks`, `/v1/hooks/register`), run on
every request; their per-request results are kept here until cleared."""

from __future__ import annotations

from typing import Any, Callable

from vllm_worker.api.hooks import HookContext
from vllm_worker.envs import limit
from vllm_worker.protocol.errors import Failure, failure
from vllm_worker.worker.plan import HookRun, hook_at
from vllm_worker.worker.request_results import RequestResults


class PersistentHooks:
    def __init__(self) -> None:
        # (fn, where it runs on this stage, point, batched, read_only)
        self.hooks: list[tuple[Callable, dict, str, bool, bool]] = []
        self.results: dict[str, list[dict]] = {}  # caller request id -> one saved dict per hook
        self.errors: dict[str, Failure] = {}  # caller request id -> failure, until popped

    def __bool__(self) -> bool:
        return bool(self.hooks)

    def register(self, hooks: list[tuple[bytes, list[int], str, bool, bool]], local_layers: frozenset) -> int:
        import cloudpickle

        for fn, layers, point, batched, read_only in hooks:
            at = hook_at(list(layers), point, local_layers)
            self.hooks.append((cloudpickle.loads(fn), at, point, batched, read_only))
        return len(self.hooks)

    def attach(
        self, runs: list[HookRun], store: RequestResults, external: str, ctx: Callable[[dict, str], HookContext]
    ) -> None:
        """A new request: add the persistent hooks to its runs (or fail it if results are full)."""
        # requests whose results are kept until `clear_hook_results`; past it new requests fail, saying so
        cap = limit("VLLM_LENS_MAX_PERSISTENT_RESULTS")
        if len(self.results) >= cap:
            store.fail(
                failure(
                    "limit",
                    f"persistent hook results are full ({cap} requests, "
                    "VLLM_LENS_MAX_PERSISTENT_RESULTS): call collect_hook_results() then "
                    "clear_hook_results()",
                    "persistent hooks",
                )
            )
            assert store.error is not None
            self.errors.setdefault(external, store.error)
            return
        saved: list[dict] = [{} for _ in self.hooks]
        self.results[external] = saved
        for i, (fn, at, point, batched, read_only) in enumerate(self.hooks):
            # a persistent hook is one function for every request: batched, they share one call per step
            runs.append(HookRun(fn, at, point, ctx(saved[i], external), i, True, batched, ("persistent", i), read_only))

    def failed(self, request_id: str, msg: str) -> None:
        """The first failure of the request's persistent hooks is the one reported (`RequestResults.fail`)."""
        self.errors.setdefault(request_id, failure("hook", msg, "persistent hook"))

    def pop_errors(self, request_ids: list[str]) -> dict[str, Failure]:
        out = {}
        for rid in request_ids:
            for k in [k for k in self.errors if k == rid or k.startswith(rid + "#")]:
                out[k] = self.errors.pop(k)
        return out

    def clear_results(self) -> None:
        self.results.clear()
        self.errors.clear()

    def clear(self) -> None:
        self.hooks.clear()
        self.clear_results()

    def status(self) -> dict[str, Any]:
        return {"persistent_hooks": len(self.hooks), "persistent_results": len(self.results)}
