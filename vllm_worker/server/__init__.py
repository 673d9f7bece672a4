"""The HTTP surface: an endpoint plugin for vLLM's OpenAI server (`vllm.endpoint_plugins`), running in the
API server's process beside the `AsyncLLM` frontend.

`endpoints` (the plugin object), `middleware` (our keys on the two generation routes: body limits,
checks on the raw JSON, results added to the response), `streaming` (the same for SSE), `choices`
(fetching and encoding one response's results), `routes` (`/v1/hooks/*`, `/v1/lens/info`), `responses`
(JSON errors, large bodies sent in pieces), `state` (what the server keeps per app).
"""

from vllm_worker.server.endpoints import LensEndpoints  # noqa: F401
