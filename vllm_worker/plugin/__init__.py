"""Bootstrap: what vLLM loads by entry point in every process (`register`, the `vllm.general_plugins`
entry `inspect_lens_worker`) and the `vllm-lens` command (`cli`)."""

from vllm_worker.plugin.bootstrap import disabled, register  # noqa: F401
