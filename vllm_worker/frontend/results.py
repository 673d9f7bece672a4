"""Transitional: `server/routes.py` still imports these names from here; at the merge it imports them from
`frontend.fetch` and this module is deleted."""

from vllm_worker.frontend.fetch import merge_collected, release_results_async  # noqa: F401
