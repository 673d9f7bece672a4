"""Transitional: `server/routes.py` still imports `mentions` from here; at the merge it imports it from
`server.choices` and this module is deleted."""

from vllm_worker.server.choices import mentions  # noqa: F401
