"""Data parallel (`--data-parallel-size N`): one frontend client feeds N engine cores, each with its own
workers and result stores. vLLM's load-balancing client (`DPLBAsyncMPClient`) sends a utility call such as
`collective_rpc` to every engine but answers with the first engine's reply only, and routes each request
to one engine. Here: which engine ran a request (recorded when vLLM routes it), RPC to one engine, and
RPC to every engine with every engine's answers."""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

from vllm_worker.compat.version import LensIncompatibleVLLM, require, wrap

logger = logging.getLogger("vllm_worker")
# why results cannot be routed between data-parallel engines on this vLLM (its client lacks what we use):
# every other feature still loads, and a request that wants results from several engines is refused
_UNAVAILABLE: list[str] = []

# client -> {our request key: indices of the engines vLLM routed it to (the samples of an n > 1 request are
# requests of their own, each routed)}; entries leave when fetched or aborted
_ROUTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# The first vLLM release whose load-balancing DP client can call every engine (`call_utility_all_async`):
# on older ones results from several data-parallel engines are refused (`routing_unavailable`).
# tests/core/test_adapter.py fails if the installed vLLM disagrees.
ROUTING_SINCE = (0, 32)


def dp_client_cls() -> type:
    from vllm.v1.engine.core_client import DPLBAsyncMPClient

    for name in ("get_core_engine_for_request", "call_utility_all_async", "_call_utility_async"):
        require(DPLBAsyncMPClient, name, "DPLBAsyncMPClient")
    return DPLBAsyncMPClient


def patch_dp_routing(key_of: Callable[[Any], str | None]) -> None:
    """Remember the engine vLLM picks for every request whose results we will fetch (`key_of(request)`: our
    key in its payload, or None). On a vLLM whose DP client lacks what this needs, nothing is patched and
    results from several engines are refused (`routing_unavailable`), never a plugin that fails to load."""
    try:
        cls = dp_client_cls()
    except (ImportError, LensIncompatibleVLLM) as e:
        _UNAVAILABLE[:] = [str(e)]
        logger.warning("inspect-lens: data-parallel result routing unavailable (%s)", e)
        return

    def make(orig: Callable) -> Callable:
        def get_core_engine_for_request(self, request, *args, **kwargs):
            engine = orig(self, request, *args, **kwargs)
            key = key_of(request)
            if key is not None:
                routes = _ROUTES.get(self)
                if routes is None:
                    routes = _ROUTES[self] = {}
                routes.setdefault(key, set()).add(list(self.core_engines).index(engine))
            return engine

        return get_core_engine_for_request

    wrap(cls, "get_core_engine_for_request", make)


def routing_unavailable() -> str | None:
    """Why results cannot be fetched from several data-parallel engines on this vLLM; None when they can."""
    return _UNAVAILABLE[0] if _UNAVAILABLE else None


def _dp_client(engine_client: Any) -> Any:
    """The load-balancing DP client behind an `AsyncLLM` (None for one engine, or one engine per client as
    with an external load balancer, where plain `collective_rpc` already reaches the right engine)."""
    client = getattr(engine_client, "engine_core", None)
    if client is None:
        return None
    if _UNAVAILABLE:
        return None
    try:
        cls = dp_client_cls()
    except (ImportError, LensIncompatibleVLLM):
        return None
    return client if isinstance(client, cls) else None


def engine_count(engine_client: Any) -> int:
    """How many engine cores this frontend's client feeds (1 without data parallelism)."""
    client = _dp_client(engine_client)
    return 1 if client is None else len(require(client, "core_engines", "DPLBAsyncMPClient"))


def engines_of(engine_client: Any, key: str) -> set[int] | None:
    """The engines that ran the request with our `key` (forgotten once asked); None without data
    parallelism or if vLLM never routed it."""
    client = _dp_client(engine_client)
    routes = _ROUTES.get(client) if client is not None else None
    return None if routes is None else routes.pop(key, None)


def forget_routes(engine_client: Any, keys: list[str]) -> None:
    client = _dp_client(engine_client)
    routes = _ROUTES.get(client) if client is not None else None
    if routes is not None:
        for k in keys:
            routes.pop(k, None)


async def rpc_engines(engine_client: Any, method: str, args: tuple, engine: int | None = None) -> list | None:
    """`collective_rpc` on one engine (`engine`) or on every engine, every worker's answer in engine order;
    None when the client has one engine (the caller uses plain `collective_rpc`)."""
    client = _dp_client(engine_client)
    if client is None:
        return None
    if engine is not None:
        target = list(client.core_engines)[engine]
        return await client._call_utility_async("collective_rpc", method, None, args, None, engine=target)
    per_engine = await client.call_utility_all_async("collective_rpc", method, None, args, None)
    return [answer for answers in per_engine for answer in answers]


def engines_fed(processor: Any) -> int:
    """How many engine cores the frontend of this input processor feeds: every data-parallel rank with
    vLLM's internal load balancer, the local ones in hybrid mode, one with an external load balancer."""
    pc = require(require(processor, "vllm_config", "InputProcessor"), "parallel_config", "VllmConfig")
    size = int(require(pc, "data_parallel_size", "ParallelConfig"))
    if size <= 1 or getattr(pc, "data_parallel_external_lb", False):
        return 1
    if getattr(pc, "data_parallel_hybrid_lb", False):
        return max(1, int(pc.data_parallel_size_local))
    return size
