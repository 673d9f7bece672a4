"""A collective RPC sent to an engine core in another process without waiting for it: vLLM's
`SyncMPClient.call_utility` (what `LLM.collective_rpc` ends in) is a send, then a wait on a future the
client's output thread completes; here the two are apart, so a caller can send several RPCs at once and
use each answer as it comes (the engine core runs utility calls one after another, in the order sent)."""

from __future__ import annotations

import uuid
from concurrent.futures import Future
from typing import Any, Callable

from vllm_worker.compat.version import require


def _sync_mp_client(llm_or_engine: Any) -> Any:
    """The `SyncMPClient` behind an `LLM` or `LLMEngine`; None for any other client (an in-process engine
    core, whose RPCs run in the caller's thread; data-parallel or async clients)."""
    from vllm.v1.engine import core_client

    cls = require(core_client, "SyncMPClient", "vllm.v1.engine.core_client")
    engine = getattr(llm_or_engine, "llm_engine", llm_or_engine)
    client = getattr(engine, "engine_core", None)
    return client if type(client) is cls else None  # (exactly: a subclass may route or wait otherwise)


def rpc_elsewhere(llm_or_engine: Any) -> bool:
    """Whether `send_rpc` can send this engine's RPCs without waiting (its engine core is another process)."""
    return _sync_mp_client(llm_or_engine) is not None


def send_rpc(llm_or_engine: Any, method: str, *args: Any) -> Callable[[], list] | None:
    """Send `collective_rpc(method, args=args)` now; returns a callable that waits for and returns its
    answers (every worker's, as `collective_rpc` returns them; an engine-side failure raises there). None
    where the engine core is not in another process (then call `rpc`)."""
    client = _sync_mp_client(llm_or_engine)
    if client is None:
        return None
    from vllm.v1.engine import EngineCoreRequestType

    utility = require(EngineCoreRequestType, "UTILITY", "EngineCoreRequestType")
    results = require(client, "utility_results", "SyncMPClient")
    send = require(client, "_send_input", "SyncMPClient")
    call_id = uuid.uuid1().int >> 64  # (as `call_utility` makes its ids)
    future: Future[Any] = Future()
    results[call_id] = future
    try:  # `call_utility`'s message: (client index, call id, utility, its args); collective_rpc's own args
        send(utility, (0, call_id, "collective_rpc", (method, None, args, None)))
    except BaseException:
        results.pop(call_id, None)
        raise
    return future.result
