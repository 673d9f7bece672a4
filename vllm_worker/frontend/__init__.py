"""The engine frontend: the process that owns `LLM` / `LLMEngine` / `AsyncLLM` (or vLLM's API server).

`state`: what the plugin keeps per engine (read by every other module here). `requests`: every new
request's features validated (`validation`), admitted against the capture limits and encoded for the
workers. `fetch`: captures and hook state fetched from the workers when a request finishes and attached
to its outputs. `llm_methods`: persistent hooks as methods of `vllm.LLM`.
"""

from vllm_worker.frontend.fetch import (  # noqa: F401
    FRONTEND_TIMINGS,
    attach_async_output,
    attach_engine_outputs,
    attach_outputs,
    release_results,
    release_results_async,
)
from vllm_worker.frontend.requests import (  # noqa: F401
    fetch_key,
    forget,
    in_flight_bytes,
    on_new_request,
    pending_count,
)
from vllm_worker.frontend.state import (  # noqa: F401
    FrontendState,
    Pending,
    PendingMap,
    consumer_of,
    engine_state,
    mark_consumer,
    mark_engine_consumer,
)
