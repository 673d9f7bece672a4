"""Sparse autoencoders in the SAELens format (`saelens`: reading `cfg.json` + `sae_weights.safetensors`, the
encode / decode math), shared by the frontend (validation, feature steering as decoder rows) and the
workers (features and clamping on the device). No vLLM import."""

from vllm_worker.sae.saelens import Sae, hook_point, load, save  # noqa: F401
